"""A resume from a checkpoint saved at an epoch's end: Lightning restores its loop at the end of that epoch, so the
resumed run first ends it (with validation on, without drawing a batch), or trains one batch in it and then asks the
loader for a new epoch (without). Each RL step still trains the batch an uninterrupted run would, and the end of
the restored epoch is no "epoch made no update"."""

import pytest

from helpers import fit_in_child, tiny_overrides
from rllight.data import ArithmeticTask, RLDataModule


def _prompts(batches):
    return [[row["prompt"] for row in batch] for batch in batches]


def test_the_loaders_next_iterator_goes_on_from_the_last_trained_batch():
    """Resumed after 8 trained batches, one epoch of 16 rows in batches of 2, validation off: Lightning trained one
    batch in the epoch it restored, counted that epoch done and made a new iterator. That iterator started the next
    epoch, skipping the 7 batches left in this one."""
    data = RLDataModule(task=ArithmeticTask(num_train=16, num_val=0), batch_size=2)
    data.setup("fit")
    uninterrupted = _prompts(data.upcoming_batches(8, 16))  # the second and third epochs
    data.load_state_dict({"batches_trained": 8})
    loader = data.train_dataloader()
    first = next(iter(loader))
    data.batches_trained += 1  # the step trained it (rllight.data.prompt_stream.PromptSource.trained)
    rest = list(loader)  # Lightning's next epoch
    assert _prompts([first, *rest]) == uninterrupted[:8]
    data.batches_trained += len(rest)
    assert _prompts(list(loader)) == uninterrupted[8:]  # and the epoch after


@pytest.mark.slow
def test_a_run_resumed_at_an_epoch_end_with_validation_on_trains_on(tmp_path, tiny_model_dir):
    """16 training rows in batches of 2, one update a rollout: 8 updates are one epoch, validated at its end and then
    saved; resumed to 12, the run stopped at once with "epoch 1 made no update"."""
    overlay = tiny_overrides(tmp_path, tiny_model_dir)
    common = ["--config", overlay, "--trainer.enable_checkpointing", "true", "--trainer.limit_val_batches", "1.0"]
    first = fit_in_child("grpo.yaml", *common, "--trainer.max_steps", "8", timeout=600)
    assert first.returncode == 0, first.stderr[-3000:]
    assert "rllight: evaluation at step 8: 1 batch (4 prompts)" in first.stdout  # at the epoch's end, before the save
    resumed = fit_in_child("grpo.yaml", *common, "--trainer.max_steps", "12", "--ckpt_path",
                           str(tmp_path / "checkpoints" / "last.ckpt"), timeout=600)
    assert resumed.returncode == 0, resumed.stdout[-2000:] + resumed.stderr[-3000:]
    assert [line.split(" | ")[0] for line in resumed.stdout.splitlines() if line.startswith("rllight: step ")] == [
        f"rllight: step {n}/12" for n in range(9, 13)]
    assert "rllight: finished: 12 RL steps, 12 optimizer updates" in resumed.stdout
