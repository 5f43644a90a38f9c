"""How much a ``yes_logprob`` verdict knows, against a judge served on 127.0.0.1 that answers each request with the
top ``top_logprobs`` tokens of a first-token distribution of its own (as vLLM and OpenAI do): the request asks for the
configured count; a "no" outside the listed tokens is read at its bound, never as P(yes) = 1; a verdict whose yes and
no hold less than ``min_mass`` fails and is counted; the logged mass is the one computed by hand, and adds up where
rewards are combined."""

from __future__ import annotations

import math

import pytest
from json_server import JSONServer

from rllight.rewards import IntegerMatch, PerSource, Sample, Weighted, scored
from rllight.rewards.judge import LLMJudge, yes_probability
from rllight.rollout.scoring import reward_metrics, score_samples
from rllight.serving import Endpoint

FILLERS = {"The": 0.08, "**": 0.08, "It": 0.08, "Correct": 0.08}
HIDDEN_NO = {"Yes": 0.48, **FILLERS, "No": 0.06, **{f"t{k}": 0.01 for k in range(14)}}
"""P(yes) = 0.48 / (0.48 + 0.06) = 8/9; "no" is the 6th likeliest token: outside a top 5, inside a top 20."""
TINY = {"The": 0.9, "A": 0.088, "Yes": 0.01, "No": 0.002}
"""Yes and no hold 0.012 of the first token: a judge that mostly answers something else."""
FIRST = {"resp-hidden": HIDDEN_NO, "resp-tiny": TINY}


class Judge(JSONServer):
    """A chat-completions server whose first answer token, for a prompt holding ``resp-<name>``, has the distribution
    ``FIRST[resp-<name>]``: it answers the likeliest token with the request's ``top_logprobs`` likeliest as its top
    log-probs; a prompt holding ``resp-down`` gets HTTP 500."""

    def answer(self, path: str, body: dict) -> tuple[int, dict]:
        prompt = body["messages"][0]["content"]
        if "resp-down" in prompt:
            return 500, {"error": "down"}
        dist = next(d for name, d in FIRST.items() if name in prompt)
        ranked = sorted(dist, key=dist.get, reverse=True)
        entry = lambda t: {"token": t, "logprob": math.log(dist[t])}  # noqa: E731
        top = [entry(t) for t in ranked[:body["top_logprobs"]]]
        choice = {"index": 0, "message": {"role": "assistant", "content": ranked[0]}, "finish_reason": "length",
                  "logprobs": {"content": [{**entry(ranked[0]), "top_logprobs": top}]}}
        return 200, {"choices": [choice]}


@pytest.fixture(scope="module")
def server():
    fake = Judge()
    yield fake
    fake.close()


def judge(server: Judge, **kwargs) -> LLMJudge:
    return LLMJudge(model="judge-model", placement=Endpoint(f"{server.url}/v1", retries=0, timeout_seconds=5.0),
                    verdict="yes_logprob", **kwargs)


def samples(*names: str, sources: tuple[str, ...] = ()) -> list[Sample]:
    return [Sample(prompt="What is 6*7?", messages=None, response=f"resp-{name}", response_ids=[1], answer="42",
                   row={"data_source": sources[i] if sources else None}, group=i) for i, name in enumerate(names)]


def test_the_request_asks_for_the_configured_top_logprobs(server):
    for kwargs, asked in (({}, 20), ({"top_logprobs": 7}, 7)):
        server.requests.clear()
        judge(server, **kwargs).score(samples("hidden"))
        (_, body, _), = server.requests
        assert body["logprobs"] is True and body["top_logprobs"] == asked and body["max_tokens"] == 1


def test_a_no_outside_the_top_log_probs_is_read_at_its_bound_not_as_p_yes_1(server):
    # Top 5: Yes 0.48 and the four fillers at 0.08; "No" (0.06) is not listed. It is read at its bound:
    # min(smallest listed 0.08, unlisted 1 - 0.48 - 4 x 0.08 = 0.20) = 0.08, so P(yes) = 0.48 / (0.48 + 0.08) = 6/7
    # (the truth is 8/9; before, 0.48 / 0.48 = 1).
    out = scored(judge(server, top_logprobs=5, min_mass=0.0), samples("hidden"))
    assert out.failed == {} and out.values == [pytest.approx(6 / 7)]
    assert out.metrics["judge/bounded"] == 1.0 and out.metrics["judge/mass_sum"] == pytest.approx(0.48)
    # Under the default min_mass (0.5) the listed mass, 0.48 (the bound left out), is too little: counted failure.
    out = score_samples(judge(server, top_logprobs=5), samples("hidden"))
    assert out.values == [0.0] and "yes and no hold 0.48 of the judge's first-token probability" in out.failed[0]
    assert reward_metrics(out)["reward/failures"] == 1.0 and out.metrics["judge/low_mass"] == 1.0
    # Asked for the default 20, the server lists "No": P(yes) is the truth, 8/9, and nothing is bounded.
    out = scored(judge(server), samples("hidden"))
    assert out.failed == {} and out.values == [pytest.approx(8 / 9)] and out.metrics["judge/bounded"] == 0.0


def test_how_yes_and_no_are_read_from_a_top_list():
    def choice(top: dict | list) -> dict:
        entries = [{"token": t, "logprob": math.log(p)} for t, p in (top.items() if isinstance(top, dict) else top)]
        return {"logprobs": {"content": [{**entries[0], "top_logprobs": entries}]}}

    # Two tokens that read "yes" (a SentencePiece "yes" and "\u2581yes" decode alike) add up: 0.5 / (0.5 + 0.25).
    assert yes_probability(choice([("yes", 0.3), ("yes", 0.2), ("No", 0.25)])) == pytest.approx(0.5 / 0.75)

    # The unlisted probability binds: 1 - 0.9 - 4 x 0.024 = 0.004 < 0.024, so P(yes) = 0.9 / 0.904.
    assert yes_probability(choice({"Yes": 0.9, **dict.fromkeys("abcd", 0.024)})) == pytest.approx(0.9 / 0.904)
    # Only "no" listed: yes at its bound min(0.05, 1 - 0.8 - 0.05) = 0.05, P(yes) = 0.05 / 0.85, not 0.
    assert yes_probability(choice({"No": 0.8, "x": 0.05})) == pytest.approx(0.05 / 0.85)
    # "No" listed at -inf (probability 0) is listed: P(yes) is exactly 1.
    listed = choice({"Yes": 0.7, "x": 0.2})
    listed["logprobs"]["content"][0]["top_logprobs"].append({"token": "No", "logprob": float("-inf")})
    assert yes_probability(listed) == 1.0


def test_a_judge_whose_yes_and_no_hold_less_than_min_mass_fails_each_sample_counted(server):
    out = score_samples(judge(server), samples("tiny", "tiny"))
    assert out.values == [0.0, 0.0] and sorted(out.failed) == [0, 1]
    assert out.failed[0] == ("yes and no hold 0.012 of the judge's first-token probability, below min_mass=0.5: it "
                             "mostly answers something else (likeliest first tokens: \"['The', 'A', 'Yes', 'No']\")")
    metrics = reward_metrics(out)
    assert metrics["reward/failures"] == 2.0 and metrics["reward/judge/low_mass"] == 2.0
    # Below a threshold of 0.01 it is read: 0.01 / 0.012.
    out = scored(judge(server, min_mass=0.01), samples("tiny"))
    assert out.failed == {} and out.values == [pytest.approx(0.01 / 0.012)] and out.metrics["judge/low_mass"] == 0.0


def test_the_logged_mass_is_the_hand_computed_one_and_adds_up_over_combined_rewards(server):
    batch = samples("hidden", "tiny", "down", "hidden", sources=("a", "b", "a", "b"))
    # Read: hidden 0.48 + 0.06 = 0.54 (top 20), tiny 0.01 + 0.002 = 0.012 (read, then failed below min_mass), hidden
    # 0.54 again; the request that failed (HTTP 500) has no mass. Sum 1.092 over 3: mean 0.364.
    metrics = reward_metrics(score_samples(judge(server), batch))
    assert metrics["reward/judge/mass_sum"] == pytest.approx(1.092) and metrics["reward/judge/mass_count"] == 3.0
    assert metrics["reward/judge/mass_sum"] / metrics["reward/judge/mass_count"] == pytest.approx(0.364)
    assert metrics["reward/judge/low_mass"] == 1.0 and metrics["reward/failures"] == 2.0
    # One judge for two data sources scores two sub-batches, and a weighted sum passes its metrics on: the same sums.
    one = judge(server)
    for reward in (PerSource({"a": one, "b": one}), Weighted({"judge": one, "exact": IntegerMatch()})):
        combined = reward_metrics(score_samples(reward, batch))
        assert {k: combined[k] for k in metrics if k.startswith("reward/judge/")} == pytest.approx(
            {k: v for k, v in metrics.items() if k.startswith("reward/judge/")})
