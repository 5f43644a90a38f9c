"""Per data source metrics of a batch's responses: each source's share of the batch and its reward and accuracy,
as evaluation reports per source (the data sources are the training rows' ``data_source`` values)."""

from __future__ import annotations


def source_metrics(sources: list, rewards: list[float] | None = None, correct: list | None = None
                   ) -> dict[str, float]:
    """Per data source of a batch's responses (``sources``, one per response): ``data/<source>/share`` (the
    realised mix of the step) and, given the responses' ``rewards`` and ``correct``, ``reward/<source>/mean`` and
    ``reward/<source>/accuracy``, as evaluation reports per source. Nothing for a batch of one source."""
    names = [str(s) for s in sources]
    if len(set(names)) < 2:
        return {}
    out = {}
    for source in sorted(set(names)):
        index = [i for i, s in enumerate(names) if s == source]
        out[f"data/{source}/share"] = len(index) / len(names)
        if rewards is not None:
            out[f"reward/{source}/mean"] = sum(float(rewards[i]) for i in index) / len(index)
        if correct is not None:
            out[f"reward/{source}/accuracy"] = sum(float(correct[i]) for i in index) / len(index)
    return out
