"""``--ckpt_path last`` finds the newest ``last.ckpt`` of an earlier run, also one that FSDP saved as a folder of
shards (``save_distributed_checkpoint``, the default of ``recipes/overlays/fsdp.yaml``): it was refused as "no
last.ckpt of an earlier run"."""

import os

from rllight._compat import newest_last_checkpoint


def test_the_newest_last_checkpoint_may_be_a_folder_of_shards(tmp_path):
    runs = tmp_path / "lightning_logs"
    older = runs / "version_0" / "checkpoints" / "last.ckpt"  # a file, written by one process
    older.parent.mkdir(parents=True)
    older.write_bytes(b"")
    sharded = runs / "version_1" / "checkpoints" / "last.ckpt"  # FSDP: its shards and meta.pt
    sharded.mkdir(parents=True)
    (sharded / "__0_0.distcp").write_bytes(b"")
    (sharded / "meta.pt").write_bytes(b"")
    empty = runs / "version_2" / "checkpoints" / "last.ckpt"  # a folder that holds no checkpoint
    empty.mkdir(parents=True)
    os.utime(older, (1, 1))
    os.utime(sharded, (2, 2))
    assert newest_last_checkpoint(str(tmp_path)) == str(sharded)
    os.utime(older, (3, 3))
    assert newest_last_checkpoint(str(tmp_path)) == str(older)
