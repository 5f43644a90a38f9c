"""A reward model: a Hugging Face sequence classifier with one label scores each (prompt, response) pair.

In a recipe::

    reward:
      class_path: rllight.rewards.RewardModel
      init_args: {model: path/or/hub-id, normalize: whiten, clip: 3.0}

It is a ``rllight.rewards.Reward`` that reads the batch, called once per batch of responses. The trainer always renders
the texts (the classifier's chat template, with its tokenizer), so that every placement scores the same strings;
``placement`` (``rllight.serving``) says where the classifier reads them:

- ``rllight.serving.InProcess`` (the default): in the trainer's process, in batches of ``batch_size`` under
  ``torch.no_grad()``. On a GPU the classifier comes onto the device for each ``score`` and goes back to the CPU after
  it, so that between scoring passes its memory is the policy's. A crash or a hang in it is the trainer's.
- ``rllight.serving.Worker``: in a supervised child process, started at the first score and stopped at ``close``; it
  keeps its weights on its device. A batch that runs past the worker's ``timeout_seconds`` or kills the child twice
  fails, counted.
- ``rllight.serving.Endpoint``: at a reward-model server, vLLM's Pooling API (``VLLMPooling``, the default protocol)
  or OpenRLHF's (``OpenRLHF``). A request that fails after its retries, or whose answer is longer than
  ``max_answer_bytes`` (64 MiB unless set: a batch's scores, one per token where the pooler gives them), fails the
  batch, counted; its reason, in the trainer's warning, has the API key masked whatever the server echoes.

The constructor only records the settings (a recipe parses without loading anything); the weights (or, for the
other placements, the tokenizer) load at the first ``score``. A copy (a checkpoint, a pickle) carries the settings.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import TYPE_CHECKING

from rllight.bounds import PositiveFiniteFloat, PositiveInt, bounded
from rllight.errors import RecipeError
from rllight.rewards.base import Reward
from rllight.rewards.scores import Sample
from rllight.serving import Failed, Placement, Protocol, ScoredText, VLLMPooling, placed
from rllight.serving.worker import serve

if TYPE_CHECKING:  # torch is imported when a reward model scores: reward worker processes import this package
    from multiprocessing.connection import Connection

    import torch

KEY = "model.reward.init_args"
NORMALIZE = ("none", "whiten")
"""The values of ``RewardModel.normalize``."""
DTYPES = ("float32", "bfloat16", "float16")
"""The dtypes ``RewardModel.dtype`` names (besides ``auto``)."""


def resolve_device(device: str) -> torch.device:
    """``auto``: this process's current CUDA device when CUDA is available, else the CPU; else ``device``."""
    import torch

    if device != "auto":
        return torch.device(device)
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    """``auto``: the dtype of the trainer's mixed-precision autocast on ``device`` where one is on, else float32;
    else the torch dtype ``dtype`` names."""
    import torch

    if dtype != "auto":
        return getattr(torch, dtype)
    if torch.is_autocast_enabled(device.type):  # the trainer's mixed precision (Lightning's forward context)
        return torch.get_autocast_dtype(device.type)
    return torch.float32


def model_config(model: str, where: str, missing: str, unreadable: str):
    """``(config, architectures)`` of the Hugging Face model ``model`` (a folder or hub id) that the setting ``where``
    names, read without its weights; ``RecipeError`` in one line for a path that is not a folder (``missing`` says
    what to give) or a model that cannot be read (``unreadable``)."""
    from transformers import AutoConfig

    if (os.sep in model or model.startswith(".")) and not os.path.isdir(model):
        raise RecipeError(f"{where}: folder {model!r} does not exist; {missing}")
    try:
        config = AutoConfig.from_pretrained(model)
    except (OSError, ValueError) as err:
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise RecipeError(f"{where}: {model!r} cannot be read as a Hugging Face model ({first}); {unreadable}") \
            from None
    return config, [a for a in (getattr(config, "architectures", None) or []) if isinstance(a, str)]


def whiten(scores: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """``(scores - mean) / (std + eps)`` over the whole batch, with the population standard deviation.

    Shape: (n,) in, (n,) out. A batch of one sample (or of equal scores) gives zeros."""
    return (scores - scores.mean()) / (scores.std(unbiased=False) + eps)


class RewardModel(Reward):
    """Score each response with a Hugging Face ``AutoModelForSequenceClassification`` that has one label.

    The scored text is the row's chat messages followed by the response as the assistant's turn, rendered with the
    classifier's own chat template (``apply_chat_template(messages + [assistant response], tokenize=False)``, the
    template's special tokens as it writes them) when its tokenizer has one and the row is a conversation; else the
    prompt as the policy saw it followed by the response (the tokenizer adds its own special tokens). The score is the
    classifier's single logit, as float32.

    Args:
        model: A folder or hub id of a sequence classifier with one label (``num_labels: 1``). At an ``Endpoint``
            its tokenizer still renders the texts, and it is the model's name in the requests (``VLLMPooling``).
        batch_size: Texts per forward pass.
        max_length: Tokens of a scored text at most; a longer text is cut from its start, so the beginning of the prompt
            goes first and the response's end is always kept (None: no limit). A server applies its own limit.
        normalize: ``none``: the classifier's score; ``whiten``: per ``score`` call (the batch of one training
            process, of one data source under ``PerSource``), ``(s - mean) / (std + eps)`` with the population std.
        clip: After normalisation, each score is clipped to ``[-clip, clip]`` (None: not clipped).
        solved_at: A response whose final score is at least this counts as solved in ``reward/accuracy``.
        dtype: The classifier's weights: ``auto`` is the trainer's precision, the dtype of the mixed-precision autocast
            that scoring runs under (``bf16-mixed``: bfloat16), else float32; or ``float32``, ``bfloat16``,
            ``float16``. The forward pass runs in this dtype, autocast off.
        device: Where it scores: ``auto`` is this process's current CUDA device (each training process's own) when
            CUDA is available, else the CPU; or a torch device (``cpu``, ``cuda:1``). A worker uses the device the
            training process would.
        eps: Added to the standard deviation when whitening.
        placement: Where the classifier runs (``rllight.serving``): ``InProcess`` (None, the default), ``Worker``
            (its ``timeout_seconds`` defaults to 300) or ``Endpoint`` (its protocol defaults to ``VLLMPooling``, whose
            requests name ``model``; its ``timeout_seconds`` to 300, its ``max_answer_bytes`` to 64 MiB).
    """

    what = "the reward model"
    default_timeout = 300.0
    default_max_answer_bytes = 64 * 2 ** 20
    """An ``Endpoint``'s ``max_answer_bytes`` where the recipe sets none: a batch's scores, per token if need be."""
    worker_target: str | None = "rllight.rewards.reward_model:serve_worker"
    """A ``Worker``'s child function (tests name one that misbehaves)."""

    @bounded
    def __init__(self, model: str, batch_size: PositiveInt = 8, max_length: PositiveInt | None = 2048,
                 normalize: str = "none", clip: PositiveFiniteFloat | None = None, solved_at: float = 0.0,
                 dtype: str = "auto", device: str = "auto", eps: float = 1e-6, placement: Placement | None = None):
        self.solved_at = solved_at
        if normalize not in NORMALIZE:
            raise RecipeError(f"{KEY}.normalize: {normalize!r} is not one of {', '.join(NORMALIZE)}")
        if dtype != "auto" and dtype not in DTYPES:
            raise RecipeError(f"{KEY}.dtype: {dtype!r} is not one of auto, {', '.join(DTYPES)}")
        self.model, self.batch_size, self.max_length = model, batch_size, max_length
        self.normalize, self.clip, self.dtype, self.device, self.eps = normalize, clip, dtype, device, eps
        self.placement = placed(placement, f"{KEY}.placement", self)
        self._net = self._tokenizer = None
        self._resident = False  # a worker's classifier stays on its device between batches

    # A copy of the reward (a checkpoint, a deep copy of the module) carries its settings, not the loaded weights.
    def __getstate__(self) -> dict:
        return {k: v for k, v in self.__dict__.items() if k not in ("_net", "_tokenizer")}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._net = self._tokenizer = None

    def close(self) -> None:
        """Drop the classifier and stop what its placement started; the next ``score`` loads (starts) it again."""
        self.placement.close()
        self._net = self._tokenizer = None

    # What a placement asks of the model it places (``rllight.serving.Served``).
    def default_protocol(self) -> Protocol:
        return VLLMPooling()

    def served_name(self) -> str:
        return self.model

    def check_local(self) -> None:
        """Nothing beyond ``check``: the tokenizer loads wherever the classifier runs."""

    # ------------------------------------------------------------------------------------------ loading
    def _target(self) -> torch.device:
        return resolve_device(self.device)

    def _weights_dtype(self, device: torch.device) -> torch.dtype:
        return resolve_dtype(self.dtype, device)

    def check(self) -> None:
        """Before the policy loads: ``model`` is a sequence classifier with one label and its tokenizer loads; at an
        ``Endpoint``, the API key's variable is set."""
        self.load_tokenizer()
        self.placement.check(self)

    def load_tokenizer(self) -> None:
        """Load the tokenizer, once, after checking that ``model`` is a sequence classifier with one label; raises
        ``RecipeError`` in one line when it cannot be read or is not one."""
        if self._tokenizer is not None:
            return
        from transformers import AutoTokenizer

        where = f"{KEY}.model: {self.model!r}"
        config, kinds = model_config(self.model, f"{KEY}.model",
                                     missing="give the reward model's folder (or hub id), e.g. what "
                                             "tools/train_reward_model.py writes",
                                     unreadable="give the folder or hub id of a sequence classifier with one label")
        if kinds and not any(a.endswith("ForSequenceClassification") for a in kinds):
            raise RecipeError(f"{where} is a {kinds[0]}, not a sequence classifier: a reward model is an "
                              "AutoModelForSequenceClassification with one label (num_labels: 1)")
        if config.num_labels != 1:
            raise RecipeError(f"{where} is a sequence classifier with {config.num_labels} labels; a reward model has "
                              "one (num_labels: 1), its score")
        tokenizer = AutoTokenizer.from_pretrained(self.model)
        if tokenizer.pad_token_id is None:  # batches are padded; the classifier reads the last token that is not
            tokenizer.pad_token = tokenizer.eos_token
        self._tokenizer = tokenizer

    def load(self, device: torch.device | None = None) -> None:
        """Load the tokenizer and the classifier (on the CPU), once; raises ``RecipeError`` in one line when
        ``model`` cannot be read or is not a sequence classifier with one label."""
        if self._net is not None:
            return
        from transformers import AutoModelForSequenceClassification

        self.load_tokenizer()
        net = AutoModelForSequenceClassification.from_pretrained(
            self.model, dtype=self._weights_dtype(device or self._target()))
        if net.config.pad_token_id is None:
            net.config.pad_token_id = self._tokenizer.pad_token_id
        self._net = net.eval().requires_grad_(False)

    # ------------------------------------------------------------------------------------------ scoring
    def text(self, sample: Sample) -> tuple[str, bool]:
        """``(text, templated)``: what the classifier reads for ``sample`` (see the class), and whether the chat
        template wrote it (then its special tokens are in the text; else the tokenizer adds them)."""
        if sample.messages and getattr(self._tokenizer, "chat_template", None):
            conversation = [*sample.messages, {"role": "assistant", "content": sample.response}]
            return self._tokenizer.apply_chat_template(conversation, tokenize=False), True
        return sample.prompt + sample.response, False

    def _encode(self, text: str, templated: bool) -> list[int]:
        ids = list(self._tokenizer(text, add_special_tokens=not templated)["input_ids"])
        return ids[-self.max_length:] if self.max_length is not None else ids  # cut from the start of the prompt

    def _ids(self, sample: Sample) -> list[int]:
        return self._encode(*self.text(sample))

    def forward(self, texts: Sequence[ScoredText | tuple[str, bool]]) -> list[float]:
        """The classifier's score of each ``(text, templated, ...)`` (``batch_size`` texts a forward pass,
        right-padded), in this process."""
        import torch

        self.load()
        device, net, pad = self._target(), self._net, self._tokenizer.pad_token_id
        out: list[float] = []
        try:
            net.to(device)
            with torch.no_grad(), torch.autocast(device.type, enabled=False):
                for start in range(0, len(texts), self.batch_size):
                    ids = [self._encode(t[0], t[1]) for t in texts[start:start + self.batch_size]]
                    width = max(len(i) for i in ids)
                    input_ids = torch.full((len(ids), width), pad, dtype=torch.long)
                    mask = torch.zeros((len(ids), width), dtype=torch.long)
                    for row, seq in enumerate(ids):
                        input_ids[row, :len(seq)] = torch.tensor(seq, dtype=torch.long)
                        mask[row, :len(seq)] = 1
                    logits = net(input_ids=input_ids.to(device), attention_mask=mask.to(device)).logits
                    out.extend(logits[:, 0].float().cpu().tolist())
        finally:
            if device.type != "cpu" and not self._resident:  # off the device between passes: the policy's memory
                net.to("cpu")
        return out

    def raw_scores(self, samples: Sequence[Sample]) -> list[float]:
        """The classifier's score of each sample, before normalisation, from where ``placement`` says; raises (a
        plain exception: the batch fails, counted) where one could not be had."""
        self.load_tokenizer()
        scores = self.placement.answer(self, [ScoredText(*self.text(s), s.prompt, s.answer) for s in samples])
        failed = next((v for v in scores if isinstance(v, Failed)), None)
        if failed is not None:
            raise failed
        return scores

    def worker_settings(self) -> dict:
        """What the worker process builds its classifier from: this one's settings, with ``dtype`` and ``device``
        resolved here (the trainer's precision, this training process's device)."""
        device = self._target()
        return {"model": self.model, "batch_size": self.batch_size, "max_length": self.max_length,
                "dtype": str(self._weights_dtype(device)).removeprefix("torch."), "device": str(device)}

    def score(self, samples: Sequence[Sample]) -> list[float]:
        """Each sample's score: the classifier's, whitened per call if ``normalize`` says so, then clipped."""
        if not samples:
            return []
        import torch

        scores = torch.tensor(self.raw_scores(samples), dtype=torch.float64)
        if self.normalize == "whiten":
            scores = whiten(scores, self.eps)
        if self.clip is not None:
            scores = scores.clamp(-self.clip, self.clip)
        return scores.tolist()


# ------------------------------------------------------------------------------------------------ worker side
def serve_worker(connection: Connection) -> None:
    """The child of a ``Worker`` placement (``rllight.serving.worker.serve``): the classifier built from the
    settings, kept on its device, scoring each batch of rendered texts."""
    serve(connection, _resident_classifier)


def _resident_classifier(settings: dict):
    model = RewardModel(**settings)
    model.load()
    model._net.to(model._target())
    model._resident = True
    return model.forward


__all__ = ["RewardModel", "model_config", "resolve_device", "resolve_dtype", "serve_worker", "whiten"]
