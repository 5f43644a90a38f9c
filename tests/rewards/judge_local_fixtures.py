"""A local judge's worker child that misbehaves on purpose, in a module the judge's worker process can import (it
gets the trainer's sys.path, where the tests' conftest puts this folder)."""

import time


def serve_hanging(connection) -> None:
    """``rllight.rewards.judge_local.serve_worker`` whose judge never answers a batch with a prompt holding
    ``HANG``."""
    from rllight.rewards import judge_local

    complete = judge_local.LocalChat.complete

    def hanging(self, bodies):
        while any("HANG" in m["content"] for b in bodies for m in b["messages"]):
            time.sleep(1)
        return complete(self, bodies)

    judge_local.LocalChat.complete = hanging
    judge_local.serve_worker(connection)
