"""The rollout buffers of coati (num_collect_steps rollouts, shuffled minibatches, drop_last) and trlx (the
rollout store: num_rollouts, shuffled minibatches per epoch, collated spans): which samples meet in which
optimizer step, and how many optimizer steps a rollout set holds."""

from __future__ import annotations

import torch

from adapters.colossalai.options import ColossalOptions
from adapters.colossalai.update import shuffled_minibatches
from adapters.trlx.experience import PPOElement
from adapters.trlx.options import TrlxOptions
from adapters.trlx.update import collate, optimizer_steps
from bench.run.config import compose
from bench.run.data import PAD
from bench.run.spec import spec_from_config


def test_coati_minibatches_are_those_of_its_shuffled_drop_last_loader():
    """2 rollouts of 4 samples (0-3 the first, 4-7 the second), the minibatches of PPOTrainer's
    DataLoader(buffer, batch_size=4, shuffle=True, drop_last=True), derived a second way: the loader's iterator
    draws a base seed from the global generator, its RandomSampler a second one, which seeds the permutation."""
    for seed in (0, 1, 41):
        torch.manual_seed(seed)
        ours = shuffled_minibatches(8, 4)
        torch.manual_seed(seed)
        torch.empty((), dtype=torch.int64).random_()  # the iterator's base seed
        generator = torch.Generator().manual_seed(int(torch.empty((), dtype=torch.int64).random_().item()))
        order = torch.randperm(8, generator=generator).tolist()
        assert ours == [order[:4], order[4:]]
        assert sorted(i for batch in ours for i in batch) == list(range(8))  # every sample once per pass
    torch.manual_seed(0)
    assert [len(b) for b in shuffled_minibatches(10, 4)] == [4, 4]  # the last partial minibatch is dropped


def test_coati_ppo_optimizer_steps_follow_the_buffer():
    def steps(*overrides: str) -> int:
        spec = spec_from_config(compose(["framework=colossalai", "stage=ppo", *overrides]))
        return ColossalOptions.from_dict(spec.framework_options).ppo_optimizer_steps(spec)

    # 10 episodes of 2 x 4 samples in minibatches of 4: 2 minibatches, one step each at grad_accum 1
    assert steps("steps=10") == 20
    assert steps("steps=10", "grad_accum=2") == 10  # train_ppo.sh's identity: one optimizer step per episode
    assert steps("steps=10", "framework.ppo.num_update_steps=5") == 100


def test_trlx_holds_16_optimizer_steps_per_rollout_set_at_upstream_defaults():
    assert optimizer_steps(num_rollouts=128, batch_size=32, ppo_epochs=4) == 16  # default_ppo_config
    assert optimizer_steps(num_rollouts=64, batch_size=4, ppo_epochs=4) == 64  # the HH example
    spec = spec_from_config(compose(["framework=trlx", "stage=ppo", "batch=4", "grad_accum=2"]))
    rollouts = TrlxOptions.from_dict(spec.framework_options).num_rollouts(spec)
    assert rollouts == 32  # 4 x batch x grad_accum
    assert optimizer_steps(rollouts, spec.batch * spec.grad_accum, 4) == 16


def test_trlx_collate_pads_answers_with_the_pad_id_and_spans_with_zeros():
    elements = [PPOElement(torch.tensor([PAD, 5]), torch.tensor([6, 7, 8]), torch.tensor([-1.0, -2.0]),
                           torch.tensor([0.5, 0.25]), torch.tensor([0.0, 1.0])),
                PPOElement(torch.tensor([9, 5]), torch.tensor([6]), torch.tensor([-3.0, -4.0, -5.0]),
                           torch.tensor([1.0, 2.0, 3.0]), torch.tensor([0.0, 0.0, 2.0]))]
    batch = collate(elements)
    assert batch["tokens"].tolist() == [[PAD, 5, 6, 7, 8], [9, 5, 6, PAD, PAD]]
    assert batch["log_probs"].tolist() == [[-1.0, -2.0, 0.0], [-3.0, -4.0, -5.0]]
    assert batch["values"].tolist() == [[0.5, 0.25, 0.0], [1.0, 2.0, 3.0]]
    assert batch["rewards"].tolist() == [[0.0, 1.0, 0.0], [0.0, 0.0, 2.0]]
    assert batch["query_width"].tolist() == [2, 2]
