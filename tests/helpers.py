import os

import yaml

from rllight.cli import RLLightCLI


def tiny_overrides(tmp_path, model_dir: str, **model_overrides) -> str:
    """A recipe overlay that swaps in the tiny model, a varying reward and a 2-step CPU budget."""
    cfg = {
        "evaluate_before_after": False,
        "trainer": {"max_steps": 2, "accelerator": "cpu", "devices": 1, "logger": False,
                    "enable_checkpointing": False, "enable_progress_bar": False, "limit_val_batches": 0,
                    "val_check_interval": None, "default_root_dir": str(tmp_path)},
        "model": {
            "model": {"class_path": "rllight.models.HFModel", "init_args": {"path": model_dir}},
            "rollout": {"class_path": "rllight.rollout.HFEngine", "init_args": {"max_new_tokens": 6}},
            "reward": {"class_path": "user_strategies.DigitReward"},
            "optimizer": {"class_path": "torch.optim.AdamW", "init_args": {"lr": 1e-2, "weight_decay": 0.0}},
            "export_dir": None,
            **model_overrides,
        },
        "data": {"batch_size": 2, "val_size": 4, "task": {"class_path": "rllight.data.ArithmeticTask",
                                                          "init_args": {"num_train": 16, "num_val": 4}}},
    }
    path = os.path.join(tmp_path, "overlay.yaml")
    with open(path, "w") as f:
        yaml.safe_dump(cfg, f)
    return path


def build(recipe: str, *extra: str) -> RLLightCLI:
    """Parse and instantiate a recipe (and overlays) without running it."""
    args = ["--config", recipe]
    for e in extra:
        args += ["--config", e] if e.endswith(".yaml") else [e]
    return RLLightCLI(args=args, run=False)
