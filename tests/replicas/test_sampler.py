"""The sampler: greedy exactness, filters, per-request seeds, penalties, and parameter validation."""

from __future__ import annotations

import pytest
import torch

from ferrox.replicas.sampler import Sampler, SamplingState, apply_penalties, apply_top_k_top_p_min_p
from ferrox.replicas.types import SamplingParams

torch.set_num_threads(1)

VOCAB = 64


def random_logits(rows: int, vocab: int = VOCAB, seed: int = 0, scale: float = 3.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, vocab, generator=g) * scale


def state(seed: int | None = None, prompt=(), output=(), **params) -> SamplingState:
    s = SamplingState.create(SamplingParams(seed=seed, **params), list(prompt), "cpu")
    s.output_token_ids.extend(output)
    return s


def test_temperature_zero_is_the_argmax_of_each_row():
    logits = random_logits(8)
    tokens = Sampler(VOCAB, "cpu")(logits, [state(temperature=0.0) for _ in range(8)])
    assert tokens.dtype == torch.int64
    assert torch.equal(tokens, logits.argmax(dim=-1))


def test_a_temperature_too_small_to_divide_by_is_greedy_not_nan():
    logits = random_logits(8, seed=5)
    tokens = Sampler(VOCAB, "cpu")(logits, [state(temperature=1e-40) for _ in range(8)])
    assert torch.equal(tokens, logits.argmax(dim=-1))


def test_top_k_one_equals_greedy_even_at_high_temperature():
    logits = random_logits(8, seed=1)
    sampler = Sampler(VOCAB, "cpu")
    top1 = sampler(logits, [state(temperature=5.0, top_k=1) for _ in range(8)])
    greedy = sampler(logits, [state(temperature=0.0) for _ in range(8)])
    assert torch.equal(top1, greedy)
    assert torch.equal(top1, logits.argmax(dim=-1))


def test_greedy_rows_stay_argmax_in_a_batch_that_also_samples():
    logits = random_logits(6, seed=2, scale=0.1)  # flat: sampled rows rarely hit the argmax
    requests = [state(temperature=0.0), state(seed=3), state(temperature=0.0, top_k=1), state(), state(seed=4), state(temperature=0.0)]
    tokens = Sampler(VOCAB, "cpu")(logits, requests)
    argmax = logits.argmax(dim=-1)
    for row in (0, 2, 5):
        assert int(tokens[row]) == int(argmax[row])


def test_the_input_logits_are_not_modified():
    logits = random_logits(3, seed=5)
    before = logits.clone()
    Sampler(VOCAB, "cpu")(logits, [state(seed=1, top_k=5, top_p=0.5, min_p=0.1, temperature=0.7), state(temperature=0.0, repetition_penalty=1.3, prompt=[1, 2]), state(presence_penalty=1.0, output=[3])])
    assert torch.equal(logits, before)


def test_the_same_seed_gives_the_same_tokens_alone_and_in_a_batch_of_four():
    steps = 20
    params = dict(temperature=0.9, top_p=0.95, top_k=40, min_p=0.01, frequency_penalty=0.3)
    sampler = Sampler(VOCAB, "cpu")

    alone = state(seed=1234, prompt=[5, 6, 7], **params)
    batched = [
        state(seed=99, prompt=[1], temperature=1.2),
        state(seed=1234, prompt=[5, 6, 7], **params),
        state(prompt=[2, 3], temperature=1.0),
        state(seed=7, prompt=[], temperature=0.5, repetition_penalty=1.2),
    ]
    for step in range(steps):
        # Flat-ish logits so the draws really vary; the seeded row sees the same row in both runs.
        logits = random_logits(4, seed=100 + step, scale=1.0)
        token_alone = sampler(logits[1:2].clone(), [alone])
        tokens = sampler(logits, batched)
        alone.output_token_ids.append(int(token_alone[0]))
        for s, t in zip(batched, tokens.tolist()):
            s.output_token_ids.append(t)

    assert batched[1].output_token_ids == alone.output_token_ids
    # The draws are genuinely random (not collapsed to the argmax): the test could fail.
    assert len(set(alone.output_token_ids)) > 5


def test_a_different_seed_gives_different_tokens():
    logits = random_logits(1, seed=8, scale=0.5)
    sampler = Sampler(VOCAB, "cpu")
    a, b = state(seed=1), state(seed=2)
    seq_a = [int(sampler(logits, [a])[0]) for _ in range(20)]
    seq_b = [int(sampler(logits, [b])[0]) for _ in range(20)]
    assert seq_a != seq_b


def test_a_tiny_top_p_keeps_only_the_argmax():
    logits = random_logits(16, seed=9, scale=0.5)
    tokens = Sampler(VOCAB, "cpu")(logits, [state(seed=i, top_p=1e-6) for i in range(16)])
    assert torch.equal(tokens, logits.argmax(dim=-1))


def test_min_p_of_one_keeps_only_the_argmax():
    logits = random_logits(16, seed=10, scale=0.5)
    tokens = Sampler(VOCAB, "cpu")(logits, [state(seed=i, min_p=1.0) for i in range(16)])
    assert torch.equal(tokens, logits.argmax(dim=-1))


def test_top_k_top_p_and_min_p_mask_exactly_the_tokens_their_definitions_remove():
    # probabilities 0.5, 0.3, 0.15, 0.05 in a scrambled order.
    probs = torch.tensor([[0.15, 0.5, 0.05, 0.3]] * 4)
    logits = probs.log()
    top_k = torch.tensor([2, 4, 4, 4])
    top_p = torch.tensor([float("inf"), 0.7, float("inf"), float("inf")])
    min_p = torch.tensor([0.0, 0.0, 0.5, 0.0])
    out = apply_top_k_top_p_min_p(logits, top_k, top_p, min_p)
    kept = torch.isfinite(out)
    assert kept.tolist() == [
        [False, True, False, True],  # top_k 2: 0.5 and 0.3
        [False, True, False, True],  # top_p 0.7: 0.5 (mass before 0) and 0.3 (mass before 0.5 < 0.7)
        [False, True, False, True],  # min_p 0.5: probability >= 0.25
        [True, True, True, True],  # nothing active
    ]
    assert torch.equal(out[kept], logits[kept])


def test_top_k_never_samples_outside_the_k_most_likely_tokens():
    logits = random_logits(1, seed=11, scale=0.3)
    allowed = set(logits[0].topk(3).indices.tolist())
    sampler = Sampler(VOCAB, "cpu")
    s = state(seed=5, top_k=3, temperature=2.0)
    drawn = {int(sampler(logits, [s])[0]) for _ in range(60)}
    assert drawn == allowed


def test_draws_follow_the_softmax_probabilities():
    probs = torch.tensor([0.6, 0.3, 0.1, 0.0])
    logits = probs.log().unsqueeze(0).repeat(4000, 1)
    sampler = Sampler(4, "cpu")
    sampler.generator.manual_seed(0)
    tokens = sampler(logits, [state() for _ in range(4000)])
    freq = torch.bincount(tokens, minlength=4).float() / 4000
    assert freq[3] == 0.0
    assert torch.allclose(freq[:3], probs[:3], atol=0.03)


def test_penalties_change_exactly_the_logits_of_counted_tokens():
    logits = torch.tensor([[1.0, -1.0, 2.0, -2.0, 3.0, 0.5], [1.0, -1.0, 2.0, -2.0, 3.0, 0.5]])
    penalised = state(
        prompt=[0, 1], output=[1, 2, 2], repetition_penalty=2.0, presence_penalty=0.5, frequency_penalty=0.25
    )
    plain = state(prompt=[0, 1], output=[1, 2, 2])
    out = apply_penalties(logits, [penalised, plain])
    # token 0 (prompt only):  1.0 / 2                        =  0.5
    # token 1 (prompt+output, count 1): -1.0 * 2 - 0.5 - 0.25 = -2.75
    # token 2 (output, count 2): 2.0 / 2 - 0.5 - 2 * 0.25    =  0.0
    # tokens 3, 4, 5 never seen: unchanged
    assert out[0].tolist() == [0.5, -2.75, 0.0, -2.0, 3.0, 0.5]
    assert out[1].tolist() == logits[1].tolist()


def test_presence_and_frequency_penalties_ignore_prompt_tokens():
    logits = torch.zeros(1, 4)
    out = apply_penalties(logits, [state(prompt=[0, 0, 1], output=[3, 3, 3], presence_penalty=1.0, frequency_penalty=-0.5)])
    # token 3: 0 - 1.0 * 1 - (-0.5) * 3 = 0.5
    assert out[0].tolist() == [0.0, 0.0, 0.0, 0.5]


def test_a_penalty_can_change_the_greedy_choice():
    logits = torch.tensor([[2.0, 1.5, 0.0, 0.0]])
    sampler = Sampler(4, "cpu")
    assert int(sampler(logits, [state(temperature=0.0)])[0]) == 0
    assert int(sampler(logits, [state(temperature=0.0, output=[0], presence_penalty=1.0)])[0]) == 1


def test_padded_vocabulary_columns_are_never_sampled():
    logits = torch.zeros(2, VOCAB + 4)
    logits[:, VOCAB:] = 100.0
    tokens = Sampler(VOCAB, "cpu")(logits, [state(temperature=0.0), state(seed=1)])
    assert all(0 <= t < VOCAB for t in tokens.tolist())


def test_a_row_count_that_does_not_match_the_requests_is_an_error():
    with pytest.raises(ValueError, match="2 rows but 1 requests"):
        Sampler(VOCAB, "cpu")(random_logits(2), [state()])


def test_a_seeded_request_gets_its_own_generator_and_an_unseeded_one_none():
    assert state(seed=3).generator is not None
    assert state(seed=3).generator.initial_seed() == 3
    assert state().generator is None


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(temperature=-1.0), "temperature"),
        (dict(top_p=0.0), "top_p"),
        (dict(top_p=1.5), "top_p"),
        (dict(max_tokens=0), "max_tokens"),
        (dict(min_p=1.5), "min_p"),
        (dict(top_k=-2), "top_k"),
        (dict(presence_penalty=2.5), "presence_penalty"),
        (dict(repetition_penalty=0.0), "repetition_penalty"),
    ],
)
def test_out_of_range_sampling_params_raise_a_value_error_naming_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


# ---------------------------------------------------------------- greedy_argmax
def test_blocked_greedy_argmax_equals_argmax_on_ties_across_and_inside_blocks_and_nan():
    from ferrox.replicas.sampler import greedy_argmax

    g = torch.Generator().manual_seed(7)
    logits = torch.randn(6, 49152, generator=g)
    logits[1, 5000] = logits[1, 40000] = 50.0  # tie across blocks: the first wins
    logits[2, 2050] = logits[2, 2051] = 60.0  # tie inside one block
    logits[3, 30000] = float("nan")  # NaN counts as largest, like argmax
    logits[4, :] = 1.0  # all equal: index 0
    logits[5, 49151] = 99.0  # the very last column
    assert greedy_argmax(logits).tolist() == logits.argmax(dim=-1).tolist()
    assert greedy_argmax(logits).tolist()[1:] == [5000, 2050, 30000, 0, 49151]


def test_greedy_argmax_falls_back_to_argmax_for_odd_widths_and_views():
    from ferrox.replicas.sampler import greedy_argmax

    odd = torch.randn(3, 1000)
    assert greedy_argmax(odd).tolist() == odd.argmax(dim=-1).tolist()
    wide = torch.randn(8, 8192)
    view = wide[:, ::2]
    assert not view.is_contiguous()
    assert greedy_argmax(view).tolist() == view.argmax(dim=-1).tolist()
