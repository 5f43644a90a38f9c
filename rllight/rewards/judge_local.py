"""A local judge model for ``LLMJudge`` placed ``InProcess`` or in a ``Worker``: a Hugging Face causal LM
answers the judge's chat requests in batches, and its answers have the form of an OpenAI chat completion, so that a
local judge and a judge behind a URL share every verdict parser.

- **The prompt** is the judge's user message in the judge model's chat template (with the generation prompt), else
  the message as plain text; batches of ``batch_size`` are left-padded and generated together.
- **Decoding**: greedy at ``temperature: 0`` (the same verdict for the same prompt), else sampled at that
  temperature from a forked random state, so that the judge never moves the training run's random streams.
- **``yes_logprob``**: the first answer token's log-probs from the raw logits (temperature 1), the request's
  ``top_logprobs`` plus every token of the vocabulary that reads ``yes`` or ``no`` (stripped, any case): P(yes) and
  the share of the first token's probability that yes and no hold (the mass ``LLMJudge.min_mass`` is checked
  against) are exact over the whole vocabulary, where a server's top log-probs may miss a variant or a side.
- **Placement** ``InProcess``: in the trainer's process, under ``torch.no_grad()``; on a GPU the judge comes onto the
  device for each batch and goes back to the CPU after it. ``Worker``: in a supervised child process
  (``rllight.serving.worker``: a batch waits at most ``timeout_seconds``, a child that dies is restarted once, a
  failed batch is counted), its weights resident on its device.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from rllight.errors import RecipeError

if TYPE_CHECKING:
    from multiprocessing.connection import Connection

    import torch

class LocalChat:
    """A causal LM that answers chat-completion request bodies (see ``rllight.rewards.judge_local``).

    Args:
        model: A folder or hub id of a causal LM (``AutoModelForCausalLM``).
        batch_size: Requests generated together.
        dtype: The weights' dtype: ``auto`` (the trainer's mixed-precision dtype, else float32), ``float32``,
            ``bfloat16`` or ``float16``.
        device: ``auto`` (this process's CUDA device, else the CPU) or a torch device.
        where: The setting's name in messages.
    """

    def __init__(self, model: str, batch_size: int = 8, dtype: str = "auto", device: str = "auto",
                 where: str = "model.reward.init_args.model"):
        self.model, self.batch_size, self.dtype, self.device, self.where = model, batch_size, dtype, device, where
        self._net = self._tokenizer = None
        self._verdict_ids: list[int] = []
        self.resident = False

    def __getstate__(self) -> dict:
        return {k: v for k, v in self.__dict__.items() if k not in ("_net", "_tokenizer")}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._net = self._tokenizer = None

    def target(self) -> torch.device:
        from rllight.rewards.reward_model import resolve_device

        return resolve_device(self.device)

    def settings(self) -> dict:
        """What a worker builds its copy from: these settings, ``dtype`` and ``device`` resolved here."""
        from rllight.rewards.reward_model import resolve_dtype

        device = self.target()
        return {"model": self.model, "batch_size": self.batch_size, "where": self.where,
                "dtype": str(resolve_dtype(self.dtype, device)).removeprefix("torch."), "device": str(device)}

    def load_tokenizer(self):
        """The judge's tokenizer, after checking that ``model`` is a causal LM; ``RecipeError`` in one line."""
        if self._tokenizer is not None:
            return self._tokenizer
        from transformers import AutoTokenizer

        from rllight.rewards.reward_model import model_config

        _, kinds = model_config(self.model, self.where,
                                missing="give the judge model's folder (or hub id), e.g. the export of a run "
                                        "(model.export_dir)",
                                unreadable="give the folder or hub id of the judge, a causal LM")
        if kinds and not any(a.endswith("ForCausalLM") or a.endswith("ForConditionalGeneration") for a in kinds):
            raise RecipeError(f"{self.where}: {self.model!r} is a {kinds[0]}, not a causal LM: a local judge "
                              "generates its verdict (AutoModelForCausalLM)")
        tokenizer = AutoTokenizer.from_pretrained(self.model)
        tokenizer.padding_side = "left"  # generated together: every prompt ends where generation starts
        if tokenizer.pad_token_id is None:
            tokenizer.pad_token = tokenizer.eos_token
        self._tokenizer = tokenizer
        return tokenizer

    def load(self) -> None:
        if self._net is not None:
            return
        from transformers import AutoModelForCausalLM

        from rllight.rewards.reward_model import resolve_dtype

        tokenizer = self.load_tokenizer()
        net = AutoModelForCausalLM.from_pretrained(self.model, dtype=resolve_dtype(self.dtype, self.target()))
        self._net = net.eval().requires_grad_(False)
        self._verdict_ids = [i for i in range(len(tokenizer))
                             if tokenizer.decode([i]).strip().lower() in ("yes", "no")]

    def _prompt(self, messages: list[dict]) -> tuple[str, bool]:
        tokenizer = self._tokenizer
        if getattr(tokenizer, "chat_template", None):
            return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True), True
        return "\n\n".join(str(m.get("content", "")) for m in messages), False

    def complete(self, bodies: list[dict]) -> list[dict]:
        """An OpenAI chat completion (``{"choices": [{"message": {"content": ...}, "logprobs": ...}]}``) for each
        request body (``messages``, ``max_tokens``, ``temperature``, ``logprobs``, ``top_logprobs``), in order."""
        import torch

        self.load()
        device, net = self.target(), self._net
        out: list[dict] = []
        try:
            net.to(device)
            with torch.no_grad(), torch.autocast(device.type, enabled=False):
                for start in range(0, len(bodies), self.batch_size):
                    out.extend(self._generate(bodies[start:start + self.batch_size], device))
        finally:
            if device.type != "cpu" and not self.resident:  # off the device between batches: the policy's memory
                net.to("cpu")
        return out

    def _generate(self, bodies: list[dict], device: torch.device) -> list[dict]:
        import torch

        tokenizer, first = self._tokenizer, bodies[0]
        prompts = [self._prompt(b["messages"]) for b in bodies]
        encoded = tokenizer([p for p, _ in prompts], add_special_tokens=not prompts[0][1], padding=True,
                            return_tensors="pt").to(device)
        temperature = float(first.get("temperature") or 0.0)
        sampling = {"do_sample": True, "temperature": temperature} if temperature > 0 else {"do_sample": False}
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
            generated = self._net.generate(
                **encoded, max_new_tokens=int(first.get("max_tokens") or 512), pad_token_id=tokenizer.pad_token_id,
                return_dict_in_generate=True, output_logits=bool(first.get("logprobs")), top_p=None, top_k=None,
                **sampling)
        new = generated.sequences[:, encoded["input_ids"].shape[1]:]
        answers = []
        for row in range(len(bodies)):
            choice = {"index": 0, "message": {"role": "assistant",
                                              "content": tokenizer.decode(new[row], skip_special_tokens=True)}}
            if first.get("logprobs"):
                first_token = self._first_token(generated.logits[0][row].float(), int(new[row, 0]),
                                                int(first.get("top_logprobs") or 0))
                choice["logprobs"] = {"content": [first_token]}
            answers.append({"choices": [choice]})
        return answers

    def _first_token(self, logits: torch.Tensor, chosen: int, top: int) -> dict:
        """OpenAI's ``logprobs.content[0]`` for the first answer token: its own log-prob and the ``top`` likeliest
        (``logits``: shape (vocab,)), with every yes / no token of the vocabulary among them."""
        logprobs = logits.log_softmax(-1)
        ids = dict.fromkeys([*logprobs.topk(min(top, logprobs.numel())).indices.tolist(), *self._verdict_ids])
        entry = lambda i: {"token": self._tokenizer.decode([i]), "logprob": float(logprobs[i])}  # noqa: E731
        return {**entry(chosen), "top_logprobs": [entry(i) for i in ids]}


def serve_worker(connection: Connection) -> None:
    """The child of a local judge placed in a ``Worker`` (``rllight.serving.worker.serve``)."""
    from rllight.serving.worker import serve

    serve(connection, _resident_chat)


def _resident_chat(settings: dict):
    chat = LocalChat(**settings)
    chat.load()
    chat._net.to(chat.target())
    chat.resident = True
    return chat.complete


__all__ = ["LocalChat", "serve_worker"]
