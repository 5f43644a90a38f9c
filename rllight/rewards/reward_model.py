"""A reward model: a Hugging Face sequence classifier with one label scores each (prompt, response) pair.

In a recipe::

    reward:
      class_path: rllight.rewards.RewardModel
      init_args: {model: path/or/hub-id, normalize: whiten, clip: 3.0}

It is a ``BatchReward`` (``rllight.rewards.batch``), called once per batch of responses. The trainer always renders
the texts (the classifier's chat template, with its tokenizer), so that every placement scores the same strings;
``placement`` says where the classifier reads them:

- ``process`` (the default): in the trainer's process, in batches of ``batch_size`` under ``torch.no_grad()``. On a
  GPU the classifier comes onto the device for each ``score`` and goes back to the CPU after it, so that between
  scoring passes its memory is the policy's. A crash or a hang in it is the trainer's.
- ``worker``: in a supervised child process (``rllight.rewards.reward_model_worker``), started at the first score and
  stopped at ``close``. On a GPU the child keeps its weights on its device (they are not the policy's memory to
  share). A batch that runs past ``timeout_seconds`` or kills the child twice fails, counted.
- ``url``: at a reward-model server, OpenRLHF's or vLLM's Pooling API (``rllight.rewards.reward_model_remote``). A
  request that fails after its retries fails the batch, counted.

The constructor only records the settings (a recipe parses without loading anything); the weights (or, for the
other placements, the tokenizer) load at the first ``score``. A copy (a checkpoint, a pickle) carries the settings.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Sequence
from typing import TYPE_CHECKING, Literal

from rllight.errors import RecipeError
from rllight.http_client import check_key_env, read_key
from rllight.rewards.batch import BatchReward, Sample
from rllight.rewards.reward_model_remote import PROTOCOLS, RemoteClassifier
from rllight.rewards.reward_model_worker import ClassifierWorker, serve

if TYPE_CHECKING:  # torch is imported when a reward model scores: reward worker processes import this package
    from multiprocessing.connection import Connection

    import torch

KEY = "model.reward.init_args"
NORMALIZE = ("none", "whiten")
"""The values of ``RewardModel.normalize``."""
DTYPES = ("float32", "bfloat16", "float16")
"""The dtypes ``RewardModel.dtype`` names (besides ``auto``)."""
PLACEMENTS = ("process", "worker", "url")
"""The values of ``RewardModel.placement``."""


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


class RewardModel(BatchReward):
    """Score each response with a Hugging Face ``AutoModelForSequenceClassification`` that has one label.

    The scored text is the row's chat messages followed by the response as the assistant's turn, rendered with the
    classifier's own chat template (``apply_chat_template(messages + [assistant response], tokenize=False)``, the
    template's special tokens as it writes them) when its tokenizer has one and the row is a conversation; else the
    prompt as the policy saw it followed by the response (the tokenizer adds its own special tokens). The score is the
    classifier's single logit, as float32.

    Args:
        model: A folder or hub id of a sequence classifier with one label (``num_labels: 1``). With ``placement:
            url`` its tokenizer still renders the texts, and it is the model's name in vLLM's requests.
        batch_size: Texts per forward pass.
        max_length: Tokens of a scored text at most; a longer text is cut from its start, so the beginning of the prompt
            goes first and the response's end is always kept (None: no limit). A server applies its own limit.
        normalize: ``none``: the classifier's score; ``whiten``: per ``score`` call (the batch of one training
            process, of one data source under ``PerSource``), ``(s - mean) / (std + eps)`` with the population std.
        clip: After normalisation, each score is clipped to ``[-clip, clip]`` (None: not clipped).
        correct: A response whose final score is at least this counts as solved in ``reward/accuracy``.
        dtype: The classifier's weights: ``auto`` is the trainer's precision, the dtype of the mixed-precision autocast
            that scoring runs under (``bf16-mixed``: bfloat16), else float32; or ``float32``, ``bfloat16``,
            ``float16``. The forward pass runs in this dtype, autocast off.
        device: Where it scores: ``auto`` is this process's current CUDA device (each training process's own) when
            CUDA is available, else the CPU; or a torch device (``cpu``, ``cuda:1``). A worker uses the device the
            training process would.
        eps: Added to the standard deviation when whitening.
        placement: Where the classifier runs: ``process`` (the trainer's), ``worker`` (a supervised child process)
            or ``url`` (a reward-model server); see ``rllight.rewards.reward_model``.
        url: ``placement: url``: the endpoint, e.g. ``http://127.0.0.1:8000/pooling`` (vLLM) or
            ``http://127.0.0.1:5000/get_reward`` (OpenRLHF).
        protocol: ``placement: url``: ``vllm_pooling`` or ``openrlhf`` (``rllight.rewards.reward_model_remote``).
        api_key_env: ``placement: url``: the NAME of the environment variable that holds the server's API key (sent as
            a bearer token), read at each batch; None = no key.
        timeout_seconds: ``worker``: longest wait for one batch's scores; ``url``: for one request's answer.
        retries: ``url``: further attempts after HTTP 429 or 5xx, a timeout or a connection error.
        backoff_seconds: ``url``: wait before the first retry; it doubles with each further one.
    """

    _worker_target = "rllight.rewards.reward_model:serve_worker"
    """The worker placement's child function (tests name one that misbehaves)."""

    def __init__(self, model: str, batch_size: int = 8, max_length: int | None = 2048, normalize: str = "none",
                 clip: float | None = None, correct: float = 0.0, dtype: str = "auto", device: str = "auto",
                 eps: float = 1e-6, placement: Literal["process", "worker", "url"] = "process",
                 url: str | None = None, protocol: Literal["vllm_pooling", "openrlhf"] = "vllm_pooling",
                 api_key_env: str | None = None, timeout_seconds: float = 300.0, retries: int = 2,
                 backoff_seconds: float = 1.0):
        super().__init__(correct=correct)
        if normalize not in NORMALIZE:
            raise RecipeError(f"{KEY}.normalize: {normalize!r} is not one of {', '.join(NORMALIZE)}")
        if clip is not None and not (isinstance(clip, (int, float)) and clip > 0 and math.isfinite(clip)):
            raise RecipeError(f"{KEY}.clip must be a positive number or null, got {clip!r}")
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise RecipeError(f"{KEY}.batch_size must be an integer >= 1, got {batch_size!r}")
        if max_length is not None and (isinstance(max_length, bool) or not isinstance(max_length, int)
                                       or max_length < 1):
            raise RecipeError(f"{KEY}.max_length must be an integer >= 1 or null, got {max_length!r}")
        if dtype != "auto" and dtype not in DTYPES:
            raise RecipeError(f"{KEY}.dtype: {dtype!r} is not one of auto, {', '.join(DTYPES)}")
        _check_placement(placement, url, protocol, api_key_env, timeout_seconds, retries, backoff_seconds)
        self.model, self.batch_size, self.max_length = model, batch_size, max_length
        self.normalize, self.clip, self.dtype, self.device, self.eps = normalize, clip, dtype, device, eps
        self.placement, self.url, self.protocol, self.api_key_env = placement, url, protocol, api_key_env
        self.timeout_seconds, self.retries, self.backoff_seconds = float(timeout_seconds), retries, backoff_seconds
        self._net = self._tokenizer = self._worker = None
        self._resident = False  # a worker's classifier stays on its device between batches

    # A copy of the reward (a checkpoint, a deep copy of the module) carries its settings, not the loaded weights.
    def __getstate__(self) -> dict:
        return {k: v for k, v in self.__dict__.items() if k not in ("_net", "_tokenizer", "_worker")}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._net = self._tokenizer = self._worker = None

    def close(self) -> None:
        """Drop the classifier and stop its worker process; the next ``score`` loads (starts) it again."""
        if self._worker is not None:
            self._worker.close()
        self._net = self._tokenizer = self._worker = None

    # ------------------------------------------------------------------------------------------ loading
    def _target(self) -> torch.device:
        return resolve_device(self.device)

    def _weights_dtype(self, device: torch.device) -> torch.dtype:
        return resolve_dtype(self.dtype, device)

    def check(self) -> None:
        """Before the policy loads: ``model`` is a sequence classifier with one label and its tokenizer loads; with
        ``placement: url``, the API key's variable is set."""
        self.load_tokenizer()
        if self.placement == "url":
            read_key(self.api_key_env, KEY, "the server's")

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

    def forward(self, texts: Sequence[tuple[str, bool]]) -> list[float]:
        """The classifier's score of each ``(text, templated)`` (``batch_size`` texts a forward pass, right-padded),
        in this process."""
        import torch

        self.load()
        device, net, pad = self._target(), self._net, self._tokenizer.pad_token_id
        out: list[float] = []
        try:
            net.to(device)
            with torch.no_grad(), torch.autocast(device.type, enabled=False):
                for start in range(0, len(texts), self.batch_size):
                    ids = [self._encode(*t) for t in texts[start:start + self.batch_size]]
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
        """The classifier's score of each sample, before normalisation, from where ``placement`` says."""
        self.load_tokenizer()
        texts = [self.text(s) for s in samples]
        if self.placement == "process":
            return self.forward(texts)
        if self.placement == "worker":
            if self._worker is None:
                self._worker = ClassifierWorker(self._worker_target, self.worker_settings(), self.timeout_seconds)
            return self._worker.score(texts)
        remote = RemoteClassifier(self.url, self.protocol, self.model, self.api_key_env, self.timeout_seconds,
                                  self.retries, self.backoff_seconds, where=KEY)
        return remote.score(texts, [s.prompt for s in samples], [s.answer for s in samples])

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


def _check_placement(placement, url, protocol, api_key_env, timeout_seconds, retries, backoff_seconds) -> None:
    """One ``RecipeError`` line, naming the setting, for a placement's settings that cannot work."""
    if placement not in PLACEMENTS:
        raise RecipeError(f"{KEY}.placement: {placement!r} is not one of {', '.join(PLACEMENTS)}")
    if protocol not in PROTOCOLS:
        raise RecipeError(f"{KEY}.protocol: {protocol!r} is not one of {', '.join(PROTOCOLS)}")
    if placement == "url":
        if not isinstance(url, str) or not re.match(r"https?://[^/\s]+", url):
            raise RecipeError(f"{KEY}.url must be the server's endpoint, starting with http:// or https://, got "
                              f"{url!r}")
        if protocol == "vllm_pooling" and not url.rstrip("/").endswith("/pooling"):
            raise RecipeError(f"{KEY}.url: vLLM's Pooling API is <server>/pooling (e.g. http://127.0.0.1:8000/pooling),"
                              f" got {url!r}")
    elif url is not None:
        raise RecipeError(f"{KEY}.url is read by placement url only (placement is {placement!r}); drop it or set "
                          "placement: url")
    check_key_env(api_key_env, KEY)
    if not (isinstance(timeout_seconds, (int, float)) and math.isfinite(timeout_seconds) and timeout_seconds > 0):
        raise RecipeError(f"{KEY}.timeout_seconds must be a positive number of seconds, got {timeout_seconds!r}")
    if isinstance(retries, bool) or not isinstance(retries, int) or retries < 0:
        raise RecipeError(f"{KEY}.retries must be an integer >= 0, got {retries!r}")
    if not (isinstance(backoff_seconds, (int, float)) and backoff_seconds >= 0):
        raise RecipeError(f"{KEY}.backoff_seconds must be a number >= 0, got {backoff_seconds!r}")


# ------------------------------------------------------------------------------------------------ worker side
def serve_worker(connection: Connection) -> None:
    """The child of ``placement: worker`` (``rllight.rewards.reward_model_worker.serve``): the classifier built from
    the settings, kept on its device, scoring each batch of rendered texts."""
    serve(connection, _resident_classifier)


def _resident_classifier(settings: dict):
    model = RewardModel(**settings)
    model.load()
    model._net.to(model._target())
    model._resident = True
    return model.forward


__all__ = ["PLACEMENTS", "RewardModel", "model_config", "resolve_device", "resolve_dtype", "serve_worker", "whiten"]
