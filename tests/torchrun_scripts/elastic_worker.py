"""A worker of ``torch.distributed.run --max-restarts=2`` (tests/test_torchrun.py): two
ranks train a few steps with a size remembered in a size file; in the first run, rank 1
holds more memory at each step (a leak that a restart frees) until its ladder is exhausted.

Usage: ``elastic_worker.py retry|find OUT SIZES``: ``retry`` sizes each step with
``oom_retry(cache=SIZES, min_batch_size=32)``, ``find`` finds the size once with
``find_batch_size(cache=SIZES)``. Each run of each rank writes ``OUT/run<R>-rank<N>.json``.
"""

from __future__ import annotations

import sys

STEPS = 3
LEAK = 20  # samples' worth rank 1 leaks at each step of the first run


def main(mode: str, out: str, sizes: str) -> None:
    from torchrun_common import record_pid

    record_pid(out)
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torchrun_common import batch, environment, make_model, write_result

    import memguard

    torch.set_num_threads(1)
    env = environment()
    rank, world, run = env["rank"], env["world_size"], env["torchelastic_restart_count"]
    dist.init_process_group("gloo")
    net = make_model()
    net.where = "forward"
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    result: dict = {**env, "steps": [], "error": None, "found": None, "found_trials": None}

    def leak(step: int) -> None:
        net.held = LEAK * step if (run == 0 and rank == 1) else 0

    def average_and_step() -> None:
        for p in net.parameters():  # outside the guarded code: every rank reaches it
            dist.all_reduce(p.grad)
            p.grad /= world
        opt.step()

    try:
        if mode == "retry":
            @memguard.oom_retry(cache=sizes, min_batch_size=32)
            def train_step(step: int, batch_size: int = 64) -> float:
                opt.zero_grad()
                # the rank read here, not held by the closure: every rank's function has one
                # code identity, so the ranks share one entry of the size file
                x, y = batch(step, dist.get_rank(), batch_size)
                loss = F.mse_loss(net(x), y)
                loss.backward()
                return loss.item()

            for step in range(STEPS):
                leak(step)
                train_step(step)
                result["steps"].append([[a.size, a.ok] for a in train_step.history])
                average_and_step()
        else:
            def trial(batch_size: int) -> None:
                opt.zero_grad()
                x, y = batch(99, dist.get_rank(), batch_size)
                F.mse_loss(net(x), y).backward()

            found = memguard.find_batch_size(trial, start=8, max_batch_size=64, margin=0.0,
                                             cache=sizes, restore=[net, opt])
            result["found"], result["found_trials"] = int(found), len(found.history)
            for step in range(STEPS):
                leak(step)
                opt.zero_grad()
                x, y = batch(step, rank, found)
                F.mse_loss(net(x), y).backward()
                result["steps"].append([[found, True]])
                average_and_step()
    except Exception as exc:
        result["error"] = f"{type(exc).__name__}: {exc}"
        raise
    finally:
        write_result(out, f"run{run}-rank{rank}", result)
    dist.barrier()  # no rank tears the group down while a peer still uses it
    dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:4])
