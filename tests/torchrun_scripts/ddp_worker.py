"""A worker of two ``torch.distributed.run`` launchers, two ranks each
(tests/test_torchrun.py): DDP training with ``auto_microbatch``; on the second node
(``MEMGUARD_TEST_NODE=1``), local rank 1 runs out of memory in backward at the first two
steps and in forward at the third, on batches larger than the simulated device's capacity.

Usage: ``ddp_worker.py OUT PLAN...``, each PLAN ``oom`` or ``clean``: one training for each,
in order, in the one process group, each from a new model, optimizer and ``auto_microbatch``
(one launch, not one a plan: each launch starts four interpreters that import torch). Each
rank writes ``OUT/<PLAN>-rank<N>.json`` for each.
"""

from __future__ import annotations

import os
import sys

# (where the hungry rank runs out of memory) for each step
PLAN = ["backward", "backward", "forward"]


def main(out: str, *plans: str) -> None:
    from torchrun_common import record_pid

    record_pid(out)
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel as DDP
    from torchrun_common import batch, environment, make_model, write_result

    import memguard

    torch.set_num_threads(1)
    env = environment()
    rank = env["rank"]
    node = int(os.environ["MEMGUARD_TEST_NODE"])
    dist.init_process_group("gloo")

    def train(plan: str) -> dict:
        hungry = plan == "oom" and node == 1 and env["local_rank"] == 1
        net = make_model()
        model = DDP(net)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)

        @memguard.auto_microbatch(model)
        def loss_of(b: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
            return F.mse_loss(model(b[0]), b[1])

        result: dict = {**env, "node": node, "hungry": hungry, "sizes": [], "losses": []}
        for step, where in enumerate(PLAN):
            net.where = where if hungry else None
            result["losses"].append(loss_of(batch(step, rank)).item())
            result["sizes"].append([a.size for a in loss_of.history])
            opt.step()
            opt.zero_grad()
        result["weights"] = [p.detach().tolist() for p in net.parameters()]
        return result

    for plan in plans:
        result = train(plan)
        dist.barrier()  # every rank done with this model before the next plan's
        write_result(out, f"{plan}-rank{rank}", result)
    dist.destroy_process_group()  # after the barrier: no peer still uses the group


if __name__ == "__main__":
    main(*sys.argv[1:])
