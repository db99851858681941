"""Run under ``torchrun``: one private run across the ranks; rank 0 writes the summary JSON."""

import json
import sys

import torch

from dpclip.training.distributed import init_from_env
from tests.distributed import _scenarios as S

if __name__ == "__main__":
    torch.set_num_threads(1)
    ctx = init_from_env()
    assert ctx is not None, "torchrun did not set WORLD_SIZE"
    res = S.train(ctx)
    if ctx.is_main:
        with open(sys.argv[1], "w") as f:
            json.dump({"world_size": ctx.world_size, "steps": res["steps"],
                       "ledger": res["ledger"], "epsilon": res["epsilon"]}, f)
    torch.distributed.destroy_process_group()
