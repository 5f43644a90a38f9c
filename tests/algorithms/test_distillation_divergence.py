"""Logit-level distillation's divergences (``rllight.algorithms.distillation``), by hand on 3- and 4-token
vocabularies: forward and reverse KL, TRL's generalised JSD and its ends, the "rest" bucket over the teacher's top-k
tokens (the student's mass outside them counts, unlike a renormalisation), the gradient of the full-vocabulary
forward KL (softmax(student) - softmax(teacher)), and the chunked path equal to the direct one in value and
gradient."""

from __future__ import annotations

import math

import pytest
import torch

from rllight.algorithms import (chunked_teacher_divergence, forward_kl, generalized_jsd, reverse_kl,
                                teacher_divergence, with_rest)
from rllight.algorithms.distillation import MIN_REST_PROB, log1mexp

ln = math.log
# A student S and a teacher T over 3 tokens, as log-probs.
S = torch.tensor([0.5, 0.25, 0.25]).log()
T = torch.tensor([1 / 8, 1 / 8, 3 / 4]).log()


def test_forward_and_reverse_kl_by_hand():
    # KL(T || S) = 1/8 ln((1/8)/(1/2)) + 1/8 ln((1/8)/(1/4)) + 3/4 ln((3/4)/(1/4))
    #            = 1/8 ln(1/4) + 1/8 ln(1/2) + 3/4 ln 3 = 3/4 ln 3 - 3/8 ln 2 = 0.82396 - 0.25993 = 0.56403
    assert float(forward_kl(S, T)) == pytest.approx(0.75 * ln(3) - 0.375 * ln(2), abs=1e-6)
    assert float(forward_kl(S, T)) == pytest.approx(0.56403, abs=1e-5)
    # KL(S || T) = 1/2 ln((1/2)/(1/8)) + 1/4 ln((1/4)/(1/8)) + 1/4 ln((1/4)/(3/4))
    #            = 1/2 ln 4 + 1/4 ln 2 - 1/4 ln 3 = 5/4 ln 2 - 1/4 ln 3 = 0.86643 - 0.27465 = 0.59178
    assert float(reverse_kl(S, T)) == pytest.approx(1.25 * ln(2) - 0.25 * ln(3), abs=1e-6)
    assert float(reverse_kl(S, T)) == pytest.approx(0.59178, abs=1e-5)
    assert float(forward_kl(T, T)) == 0.0 and float(reverse_kl(S, S)) == 0.0


@pytest.mark.parametrize("beta", [0.5, 0.25])
def test_the_generalized_jsd_by_hand(beta):
    # M = beta T + (1 - beta) S; JSD = beta KL(T || M) + (1 - beta) KL(S || M)
    s, t = [0.5, 0.25, 0.25], [1 / 8, 1 / 8, 3 / 4]
    m = [beta * ti + (1 - beta) * si for si, ti in zip(s, t)]  # beta 0.5: (5/16, 3/16, 1/2)
    kl_t = sum(ti * ln(ti / mi) for ti, mi in zip(t, m))  # beta 0.5: 1/8 ln(2/5) + 1/8 ln(2/3) + 3/4 ln(3/2)
    kl_s = sum(si * ln(si / mi) for si, mi in zip(s, m))  # beta 0.5: 1/2 ln(8/5) + 1/4 ln(4/3) + 1/4 ln(1/2)
    assert float(generalized_jsd(S, T, beta)) == pytest.approx(beta * kl_t + (1 - beta) * kl_s, abs=1e-6)
    if beta == 0.5:  # the symmetric JSD (at most ln 2): 0.5 (0.13888 + 0.13364) = 0.13626, worked out in full
        assert float(generalized_jsd(S, T, beta)) == pytest.approx(
            0.5 * (ln(2 / 5) / 8 + ln(2 / 3) / 8 + 0.75 * ln(1.5)) + 0.5 * (0.5 * ln(1.6) + 0.25 * ln(4 / 3)
                                                                              + 0.25 * ln(0.5)), abs=1e-6)
        assert float(generalized_jsd(S, T, beta)) == pytest.approx(0.13626, abs=1e-5)


def test_the_jsd_ends_are_trls_forward_and_reverse_kl():
    """TRL's GKDConfig.beta: 0.0 is the KL divergence KL(teacher || student), 1.0 the inverse KL(student || teacher)."""
    assert float(generalized_jsd(S, T, 0.0)) == float(forward_kl(S, T))
    assert float(generalized_jsd(S, T, 1.0)) == float(reverse_kl(S, T))
    assert float(generalized_jsd(S, S, 0.3)) == pytest.approx(0.0, abs=1e-7)


def test_the_rest_bucket_holds_the_mass_outside_the_k_tokens():
    # (1/2, 1/4) -> rest 1 - 3/4 = 1/4
    out = with_rest(torch.tensor([0.5, 0.25]).log())
    torch.testing.assert_close(out.exp(), torch.tensor([0.5, 0.25, 0.25]))
    # Where the k tokens hold everything the rest is floored (not log 0 = -inf), and so is its gradient's cause:
    full = torch.tensor([0.5, 0.5]).log().requires_grad_()
    rest = with_rest(full)[-1]
    assert float(rest) == pytest.approx(ln(MIN_REST_PROB), abs=1e-3)
    rest.backward()
    assert torch.isfinite(full.grad).all()
    assert float(log1mexp(torch.tensor(-1e-3))) == pytest.approx(ln(1 - math.exp(-1e-3)), rel=1e-5)  # near 0
    assert float(log1mexp(torch.tensor(-30.0))) == pytest.approx(-math.exp(-30.0), rel=1e-5)  # far below


def test_over_the_top_k_with_one_token_left_the_rest_is_that_token():
    """Vocabulary 3, top 2: the rest bucket is the third token, so the k + 1 divergence is the full one."""
    student_logits = torch.tensor([[2.0, 0.5, -1.0]])
    teacher_full = torch.tensor([[3 / 16, 1 / 16, 3 / 4]]).log()
    ids = torch.tensor([[2, 0]])  # the teacher's top 2: 3/4 and 3/16
    top = teacher_full.gather(-1, ids)
    for beta in (0.0, 0.5, 1.0):
        torch.testing.assert_close(teacher_divergence(student_logits, top, ids, beta),
                                   teacher_divergence(student_logits, teacher_full, None, beta))


def test_over_the_top_k_by_hand_with_two_tokens_in_the_rest():
    # Vocabulary 4: student (1/2, 1/4, 1/8, 1/8), teacher's top 2 are ids 1 and 0 with (1/2, 1/4), its rest 1/4.
    # The student at ids (1, 0): (1/4, 1/2), its rest 1/8 + 1/8 = 1/4.
    student_logits = torch.tensor([0.5, 0.25, 0.125, 0.125]).log()
    ids, top = torch.tensor([1, 0]), torch.tensor([0.5, 0.25]).log()
    # forward KL over (id 1, id 0, rest): 1/2 ln((1/2)/(1/4)) + 1/4 ln((1/4)/(1/2)) + 1/4 ln((1/4)/(1/4))
    #                                     = 1/2 ln 2 - 1/4 ln 2 + 0 = 1/4 ln 2 = 0.17329
    assert float(teacher_divergence(student_logits, top, ids, 0.0)) == pytest.approx(0.25 * ln(2), abs=1e-6)
    # reverse KL: 1/4 ln((1/4)/(1/2)) + 1/2 ln((1/2)/(1/4)) + 1/4 ln 1 = -1/4 ln 2 + 1/2 ln 2 = 1/4 ln 2
    assert float(teacher_divergence(student_logits, top, ids, 1.0)) == pytest.approx(0.25 * ln(2), abs=1e-6)


def test_the_students_mass_outside_the_top_k_counts_unlike_a_renormalisation():
    """Two students alike on the teacher's top 2 tokens relative to each other (2:1), one with more mass outside
    them: renormalised over the 2 tokens they would be the same; with the rest bucket the second is further."""
    ids, top = torch.tensor([0, 1]), torch.tensor([0.6, 0.3]).log()
    near = torch.tensor([0.6, 0.3, 0.05, 0.05]).log()  # the teacher's own proportions: rest 0.1 = the teacher's
    far = torch.tensor([0.4, 0.2, 0.2, 0.2]).log()  # 2:1 too, but rest 0.4
    assert float(teacher_divergence(near, top, ids, 0.0)) == pytest.approx(0.0, abs=1e-6)
    # far, over (id 0, id 1, rest): 0.6 ln(0.6/0.4) + 0.3 ln(0.3/0.2) + 0.1 ln(0.1/0.4)
    #      = 0.9 ln 1.5 - 0.1 ln 4 = 0.36492 - 0.13863 = 0.22629
    assert float(teacher_divergence(far, top, ids, 0.0)) == pytest.approx(
        0.6 * ln(1.5) + 0.3 * ln(1.5) + 0.1 * ln(0.25), abs=1e-6)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_the_full_vocabulary_forward_kl_gradient_is_softmax_student_minus_softmax_teacher(temperature):
    torch.manual_seed(0)
    logits = torch.randn(5, 7, dtype=torch.float64, requires_grad=True)
    teacher = torch.log_softmax(torch.randn(5, 7, dtype=torch.float64), -1)
    teacher_divergence(logits, teacher, None, beta=0.0, temperature=temperature).sum().backward()
    # d/dz sum_i p_T(i) (log p_T(i) - log softmax(z / tau)_i) = (softmax(z / tau) - p_T) / tau
    expected = (torch.softmax(logits.detach() / temperature, -1) - teacher.exp()) / temperature
    torch.testing.assert_close(logits.grad, expected)


@pytest.mark.parametrize("top_k", [3, None])
def test_the_chunked_path_equals_the_direct_one_in_value_and_gradient(top_k):
    torch.manual_seed(0)
    head = torch.nn.Linear(8, 11, dtype=torch.float64)
    hidden = torch.randn(13, 8, dtype=torch.float64, requires_grad=True)
    teacher = torch.log_softmax(torch.randn(13, 11, dtype=torch.float64), -1)
    ids = teacher.topk(top_k, -1).indices if top_k else None
    values = teacher.gather(-1, ids) if top_k else teacher
    direct = teacher_divergence(head(hidden), values, ids, 0.5, 0.7)
    grads = torch.autograd.grad(direct.sum(), [hidden, head.weight])
    chunked = chunked_teacher_divergence(hidden, head, values, ids, 0.5, 0.7, chunk_size=4)  # chunks 4, 4, 4, 1
    torch.testing.assert_close(chunked, direct)
    for got, want in zip(torch.autograd.grad(chunked.sum(), [hidden, head.weight]), grads):
        torch.testing.assert_close(got, want)
