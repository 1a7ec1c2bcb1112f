"""Where each re-creation puts the score and which actions enter its losses when the pad id is the EOS id (as
upstream's tokenizers make it), the coati critic's start and positions, DS-Chat's value clamp and trlx's
whitening: hand-made tensors, values worked by hand."""

from __future__ import annotations

import pytest
import torch

from adapters.dschat.reward_model import end_index
from adapters.dschat.update import critic_loss_fn
from adapters.rl_math import kl_penalised_rewards, position_ids
from adapters.trlx.experience import stored_rewards, stored_span
from adapters.trlx.update import whiten
from bench.run.data import EOS, PAD, pad_is_eos_mask

# prompt of 3 tokens (start = 2, the last prompt position), answers in columns 3-5:
# row 0 the batch's longest (2 tokens + EOS), row 1 one token + EOS, row 2 EOS at once, row 3 no EOS at all
P = 9
SEQ = torch.tensor([[P, P, P, 5, 6, EOS],
                    [P, P, P, 7, EOS, PAD],
                    [P, P, P, EOS, PAD, PAD],
                    [P, P, P, 5, 6, 7]])
START = 2


def test_pad_is_eos_mask_masks_eos_like_padding():
    assert pad_is_eos_mask(SEQ).tolist() == [[1, 1, 1, 1, 1, 0], [1, 1, 1, 1, 0, 0], [1, 1, 1, 0, 0, 0],
                                             [1, 1, 1, 1, 1, 1]]


def test_trlx_stores_answer_eos_and_one_pad_action_and_the_score_lands_on_the_last():
    mask = pad_is_eos_mask(SEQ)
    # ends = start + mask[:, 2:].sum + 1, cut at the 5 log-probs: 6 -> 5, 5, 4, 7 -> 5
    assert stored_span(mask, START).tolist() == [[1, 1, 1], [1, 1, 1], [1, 1, 0], [1, 1, 1]]
    log_probs = torch.zeros(4, 5)
    ref_log_probs = -torch.ones(4, 5)  # log-ratio 1 on every action before masking
    scores = torch.tensor([1.0, 2.0, 3.0, 4.0])
    log_ratio, span, rewards = stored_rewards(log_probs, ref_log_probs, mask, START, scores, kl_coef=0.1)
    # each action masked by its preceding token: row 1's pad action follows the EOS (masked), so no KL there
    assert log_ratio[:, START:].tolist() == [[1, 1, 1], [1, 1, 0], [1, 0, 0], [1, 1, 1]]
    expected = torch.tensor([[-0.1, -0.1, 0.9],    # the longest: the score on its EOS action
                             [-0.1, -0.1, 2.0],    # shorter: on the pad action after its EOS
                             [-0.1, 3.0, 0.0],     # EOS first: on the pad action after it
                             [-0.1, -0.1, 3.9]])   # no EOS: on its last answer token
    assert torch.allclose(rewards, expected)
    # the loss mask, loss()'s attention_mask[:, start + 1:]: answer tokens only, never the EOS
    assert mask[:, 1:][:, START:].tolist() == [[1, 1, 0], [1, 0, 0], [0, 0, 0], [1, 1, 1]]


def test_dschat_drops_the_eos_action_from_the_losses_and_lands_the_score_on_it():
    action_mask = pad_is_eos_mask(SEQ)[:, 1:]
    assert action_mask[:, START:].tolist() == [[1, 1, 0], [1, 0, 0], [0, 0, 0], [1, 1, 1]]
    zeros = torch.zeros(4, 5)
    rewards, ends = kl_penalised_rewards(zeros, zeros, torch.tensor([1.0, 2.0, 3.0, 9.0]), START, action_mask,
                                         kl_coef=0.1, clip=5.0, one_past=True)
    # ends = start + mask.sum + 1: the EOS action (columns 4, 3, 2); without EOS the last action, 5 cut to 5
    assert ends.tolist() == [5, 4, 3, 5]
    assert rewards[:, START:].tolist() == [[0, 0, 1], [0, 2, 0], [3, 0, 0], [0, 0, 5]]  # 9 clipped to 5


def test_dschat_on_a_llama_tokenizer_keeps_the_eos_action_and_lands_the_score_one_past_it():
    """get_tokenizer gives a Llama model path a [PAD] of its own, so `seq.not_equal(pad_token_id)` keeps the EOS
    action in both losses, compute_rewards' `ends = start + mask.sum + 1` puts the score on the action after the
    EOS (the first pad action; where a row runs to the end, its last action), and forward_value reads the value at
    the EOS, the token before the first pad."""
    from adapters.dschat.options import pad_is_eos

    assert not pad_is_eos("llama") and pad_is_eos("gpt2") and pad_is_eos("qwen2")
    action_mask = (SEQ != PAD).long()[:, 1:]
    assert action_mask[:, START:].tolist() == [[1, 1, 1], [1, 1, 0], [1, 0, 0], [1, 1, 1]]
    zeros = torch.zeros(4, 5)
    rewards, ends = kl_penalised_rewards(zeros, zeros, torch.tensor([1.0, 2.0, 3.0, 9.0]), START, action_mask,
                                         kl_coef=0.1, clip=5.0, one_past=True)
    # 2 + 3 + 1 = 6 cut to 5 (row 0's EOS is the last action), 2 + 2 + 1 = 5, 2 + 1 + 1 = 4, 6 cut to 5
    assert ends.tolist() == [5, 5, 4, 5]
    assert rewards[:, START:].tolist() == [[0, 0, 1], [0, 0, 2], [0, 3, 0], [0, 0, 5]]
    # the value at the EOS (columns 5, 4, 3) where a row has one, else the last token
    assert (end_index(SEQ, prompt_length=3, pad_is_eos=False) - 1).tolist() == [5, 4, 3, 5]


def test_dschat_reward_model_reads_the_token_before_the_first_eos_after_the_prompt():
    # forward_value reads index end - 1: the last answer token (6, 7), the last prompt token, the last token
    assert (end_index(SEQ, prompt_length=3) - 1).tolist() == [4, 3, 2, 5]
    # step 2's pairs (right padded, no prompt offset): the same rule over the whole row
    assert end_index(torch.tensor([[P, 5, EOS, PAD], [P, 5, 6, 7]])).tolist() == [2, 4]


def test_dschat_clamps_values_in_the_model_dtype_before_the_upcast():
    values = torch.tensor([[1.0]], dtype=torch.float16)
    old = torch.tensor([[0.1]], dtype=torch.float16)  # 0.0999755859375 in fp16
    returns = torch.tensor([[2.0]])
    mask = torch.ones(1, 1)
    # the bound old + 0.2 in fp16: 0.0999755859375 + 0.199951171875 (0.2 in fp16) = 0.2999267578125, half way
    # between two steps of the fp16 grid (2^-12 there), rounds to the even one, 0.2998046875; the clipped error
    # (2 - 0.2998046875)^2 = 2.8906641 beats the plain one, 1; half of it
    assert float(critic_loss_fn(values, old, returns, mask, 0.2, fp32=True)) == pytest.approx(1.4453321, abs=1e-7)
    # clamping after an fp32 upcast would have given (2 - 0.2999755859375 - 0.2)^2 / 2 = 1.4450415
    assert float(critic_loss_fn(values.float(), old.float(), returns, mask, 0.2, fp32=True)) == pytest.approx(
        1.4450415, abs=1e-6)


def test_trlx_whitens_with_the_unbiased_variance_only_where_upstream_has_no_process_group():
    # mean 2.5; without a process group (one process, no DeepSpeed) the unbiased variance 5/3
    assert whiten(torch.tensor([1.0, 2.0, 3.0, 4.0])).tolist() == pytest.approx(
        [-1.1618950, -0.3872983, 0.3872983, 1.1618950], abs=1e-6)
    # with one (DeepSpeed starts it even for a single process): get_global_statistics' biased 1.25
    assert whiten(torch.tensor([1.0, 2.0, 3.0, 4.0]), grouped=True).tolist() == pytest.approx(
        [-1.3416408, -0.4472136, 0.4472136, 1.3416408], abs=1e-6)


def _tiny_spec():
    from bench.run.config import compose
    from bench.run.spec import spec_from_config

    return spec_from_config(compose(["framework=colossalai", "stage=ppo"]))


def test_coati_critic_starts_from_the_sft_backbone_with_a_fresh_head(tmp_path):
    """train_ppo.py's Critic(--rm_pretrain) with no --critic_checkpoint_path: the default options build the
    critic from the SFT model's backbone and a new value head, not the RM's trained one."""
    from adapters.colossalai.engines import Engines
    from adapters.colossalai.models import Critic, RewardModel
    from adapters.colossalai.options import ColossalOptions
    from bench.run.models import build_backbone, build_causal_lm

    spec = _tiny_spec()
    options = ColossalOptions.from_dict(spec.framework_options)
    assert options.critic_from_rm is False
    torch.manual_seed(7)  # the "SFT" and "RM" weights: other draws than the adapter's seeded builds
    sft = build_causal_lm(spec.model)
    rm = RewardModel(build_backbone(spec.model))
    torch.nn.init.normal_(rm.value_head.weight)
    torch.save(sft.state_dict(), tmp_path / "sft.pt")
    torch.save(rm.state_dict(), tmp_path / "rm.pt")
    engines = Engines()
    engines.spec, engines.options = spec, options
    critic = engines._value_model(Critic, None, backbone_from_lm=str(tmp_path / "sft.pt"))
    for name, tensor in critic.model.state_dict().items():
        assert torch.equal(tensor, sft.state_dict()[f"transformer.{name}"]), name
    assert not torch.allclose(critic.value_head.weight, rm.value_head.weight)


def test_coati_s_critic_keeps_nn_linear_s_head_and_only_the_reward_model_re_initialises_it():
    """critic.py: `self.value_head = nn.Linear(hidden, 1)`, nothing more; reward_model.py re-draws the weight
    normal with std 1 / (hidden + 1). Each head against the same draws made by hand from the same seed."""
    from adapters.colossalai.models import Critic, RewardModel
    from bench.run.models import build_backbone

    model = _tiny_spec().model
    hidden = model.hidden
    torch.manual_seed(3)
    critic = Critic(build_backbone(model))
    torch.manual_seed(3)
    build_backbone(model)
    plain = torch.nn.Linear(hidden, 1)
    assert torch.equal(critic.value_head.weight, plain.weight) and torch.equal(critic.value_head.bias, plain.bias)
    torch.manual_seed(3)
    reward = RewardModel(build_backbone(model))
    torch.manual_seed(3)
    build_backbone(model)
    drawn = torch.nn.Linear(hidden, 1)
    drawn.weight.data.normal_(mean=0.0, std=1 / (hidden + 1))
    assert torch.equal(reward.value_head.weight, drawn.weight) and torch.equal(reward.value_head.bias, drawn.bias)


def test_coati_s_sampler_leaves_rows_unfinished_at_the_last_step_and_never_samples_the_pad_id():
    """coati/models/generation.py `_sample` (ColossalAI 4f9953be): a row still running at the last step is returned
    as it is, no stop token forced. Upstream's pad id is the EOS (train_ppo.py: pad_token = eos_token), so sampling
    it ends a row; the harness's pad differs from its EOS and is masked instead (the declared deviation), so no row
    holds a pad. A forward that prefers the pad id above all and never the EOS: every row runs to the end with
    neither a pad nor an EOS in it."""
    from adapters.colossalai.generation import sample

    vocab, eos, pad = 8, 2, 0

    def forward(input_ids, **_):
        logits = torch.zeros(input_ids.shape[0], input_ids.shape[1], vocab)
        logits[..., pad] = 50.0  # the pad id is by far the likeliest
        logits[..., eos] = -50.0  # the EOS practically never
        return logits, None

    prompts = torch.tensor([[pad, 5, 6], [4, 5, 6]])
    mask = (prompts != pad).long()
    torch.manual_seed(0)
    seq, seq_mask = sample(forward, prompts, mask, max_length=8, eos_id=eos, pad_id=pad, temperature=0.7, top_k=3)
    generated = seq[:, 3:]
    assert generated.shape == (2, 5)
    assert not (generated == pad).any() and not (generated == eos).any()
    assert seq_mask[:, 3:].eq(1).all()


def test_coati_critic_values_ignore_left_padding_with_the_actor_s_positions():
    """A left-padded row's values at its real tokens equal those of the same row unpadded (a second computation),
    once the critic gets the positions the actor's forwards use."""
    from adapters.colossalai.models import Critic
    from bench.run.models import build_backbone

    torch.manual_seed(0)
    critic = Critic(build_backbone(_tiny_spec().model)).eval()
    row = torch.tensor([[5, 6, 7, 8]])
    padded = torch.tensor([[PAD, PAD, 5, 6, 7, 8]])
    mask = (padded != PAD).long()
    with torch.no_grad():
        alone = critic(row, torch.ones_like(row), position_ids(torch.ones_like(row)))
        with_positions = critic(padded, mask, position_ids(mask))[:, 2:]
        without = critic(padded, mask)[:, 2:]
    assert torch.allclose(with_positions, alone, atol=1e-5)
    assert not torch.allclose(without, alone, atol=1e-3)  # what the critic computed before: shifted positions
