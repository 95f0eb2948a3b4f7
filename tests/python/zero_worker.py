"""One rank of the ZeRO tests (test_torch_zero.py), launched by torchrun on gloo: an MLP
trained with strata.torch.optim.AdamW(partition=True) on its slice of a global batch.

  zero_worker.py OUT OFFLOAD STEPS [--save CKPT] [--load CKPT] [--fail-rank R]

Rank 0 writes OUT (torch.save): the parameters after the steps, the losses, each rank's
offloaded elements and, with --save, the optimizer's gathered state after the steps to CKPT.
--load starts from CKPT (parameters and optimizer state) instead of from the seed.
--fail-rank R makes rank R's state I/O fail during the second step (io.faults).
--hang-rank R makes rank R stop before its second step until every other rank has raised its
timeout and written its report (a wait on those files, capped at 20 x --timeout, not a fixed
sleep): each rank records the error it raised (rank R's own peers are gone by then) and exits.
--dist nccl --device cuda: the same on NCCL with the model and batches on the rank's GPU
(bench/gpu-check.sh, N = 1); OUT's parameters are copied to the CPU."""

import argparse
import copy
import datetime
import faulthandler
import json
import os
import sys
import tempfile
import time

import strata
import strata.torch as st
import torch
import torch.distributed as dist

GLOBAL_BATCH = 12


def mlp(width=48):
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(16, width),
        torch.nn.GELU(),
        torch.nn.Linear(width, width),
        torch.nn.Linear(width, 4),
    )


def batches(n):
    g = torch.Generator().manual_seed(1)
    return [
        (torch.randn(GLOBAL_BATCH, 16, generator=g), torch.randn(GLOBAL_BATCH, 4, generator=g))
        for _ in range(n)
    ]


def main():
    faulthandler.enable()  # an abort prints where each thread was
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("offload")
    ap.add_argument("steps", type=int)
    ap.add_argument("--save")
    ap.add_argument("--load")
    ap.add_argument("--first", type=int, default=0, help="index of the first batch")
    ap.add_argument("--fail-rank", type=int, default=-1)
    ap.add_argument("--width", type=int, default=48)
    ap.add_argument("--hang-rank", type=int, default=-1)
    ap.add_argument("--timeout", type=float, default=60)
    ap.add_argument("--bucket-size", type=int, default=1000)
    ap.add_argument("--save-at", type=int, default=-1, help="--save after this many steps")
    ap.add_argument("--dist", default="gloo", choices=["gloo", "nccl"])
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    args = ap.parse_args()
    dist.init_process_group(args.dist, timeout=datetime.timedelta(seconds=args.timeout))
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)
    device = torch.device(args.device, rank) if args.device == "cuda" else torch.device("cpu")
    if args.device == "cuda":
        torch.cuda.set_device(device)
    model = mlp(args.width).to(device)
    nvme = tempfile.mkdtemp(prefix=f"strata-zero-rank{rank}-")  # each rank its own directory
    kw = {
        "lr": 1e-2,
        "weight_decay": 0.01,
        "offload": args.offload,
        "partition": True,
        "bucket_size": args.bucket_size,
    }
    if args.offload == "nvme":
        kw["nvme_dir"] = nvme
    if args.fail_rank == rank:
        kw["runtime"] = strata.Runtime(
            {
                "backend": "host",
                "device_budget": "4MiB",
                "host_budget": "320KiB",
                "host_copy_on_the_way": False,
                "io": {"faults": ["read:6:eio"]},
                "nvme": {"paths": [nvme], "capacity": "64MiB", "stripe": "256KiB"},
                "quiet": True,
            }
        )
        kw["offload"] = "nvme"
        kw["prefetch"] = "none"  # every read is the step's own: the 6th fails in a step
    opt = st.optim.AdamW(model.parameters(), **kw)
    if args.load:
        saved = torch.load(args.load)
        model.load_state_dict(saved["model"])
        opt.load_state_dict(saved["optimizer"])
    per_rank = GLOBAL_BATCH // world
    losses, error = [], None
    saved_state = saved_model = torch_copy = None
    for i, (x, y) in enumerate(batches(args.first + args.steps)[args.first :]):
        if i == 1 and rank == args.hang_rank:  # a rank that hangs: the others must not wait forever
            wait_for_reports(args.out, [r for r in range(world) if r != rank], 20 * args.timeout)
        xs, ys = (
            x[rank * per_rank : (rank + 1) * per_rank].to(device),
            y[rank * per_rank : (rank + 1) * per_rank].to(device),
        )
        loss = torch.nn.functional.mse_loss(model(xs), ys)
        try:
            loss.backward()  # launches the buckets' reduce-scatters as they fill
            opt.step()
        except st.DistributedError as e:
            error = str(e)
            break
        opt.zero_grad()
        losses.append(loss.item())
        if args.save and i + 1 == args.save_at:  # a checkpoint mid-run (a collective)
            saved_state = opt.state_dict()
            saved_model = {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
            torch_copy = copy.deepcopy(model) if rank == 0 else None  # as a user would
    if args.hang_rank >= 0:  # the process group is broken: each rank reports on its own
        with open(f"{args.out}.rank{rank}.json.tmp", "w") as f:
            json.dump({"error": error, "steps": len(losses)}, f)
        os.replace(f"{args.out}.rank{rank}.json.tmp", f"{args.out}.rank{rank}.json")
        opt.close()
        exit_now()
    if args.save_at >= 0:
        state = saved_state
    else:
        state = opt.state_dict() if args.save and error is None else None
        saved_model = model.state_dict()
    torch_next = None
    if torch_copy is not None:  # torch.optim.AdamW resumes the checkpoint on the copy
        # torch's load_state_dict keeps the state's tensors and steps them in place: a copy.
        torch_next = torch_resumes(torch_copy, copy.deepcopy(state), args.first + args.save_at)
    offloaded = [None] * world
    dist.all_gather_object(offloaded, opt._zero.offloaded_elements)
    if rank == 0:
        torch.save(
            {
                "params": [p.detach().cpu().clone() for p in model.parameters()],
                "losses": losses,
                "offloaded": offloaded,
                "error": error,
                "torch_next": torch_next,
            },
            args.out,
        )
        if state is not None:
            torch.save({"model": saved_model, "optimizer": state}, args.save)
    if args.fail_rank >= 0 and rank != 0:  # every rank saw the same error
        assert error is not None and f"rank {args.fail_rank} of {world}" in error, error
    opt.close()
    dist.destroy_process_group()
    exit_now()


def wait_for_reports(out, ranks, cap_s):
    """Block until each of `ranks` has written its report (its timeout raised), or `cap_s`."""
    deadline = time.monotonic() + cap_s
    while not all(os.path.exists(f"{out}.rank{r}.json") for r in ranks):
        if time.monotonic() > deadline:
            raise SystemExit(f"the other ranks wrote no report in {cap_s:.0f} s")
        time.sleep(0.05)


def torch_resumes(model, state, batch):
    """One step of torch.optim.AdamW over `model` (rank 0's deep copy of the trained model)
    from strata's gathered `state`, on the whole global batch `batch`: its parameters."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01, foreach=False)
    opt.load_state_dict(state)
    x, y = batches(batch + 1)[batch]
    torch.nn.functional.mse_loss(model(x), y).backward()
    opt.step()
    return [p.detach().clone() for p in model.parameters()]


def exit_now() -> None:
    """Ends the rank without the interpreter's finalisation. With torch 2.15 on gloo, the process
    group outlives destroy_process_group() once an optimizer exists (torch.optim's own too), and
    a gloo worker thread still dropping the last collective's tensors takes the GIL while the
    interpreter finalises: an abort, "terminate called without an active exception" (torch
    issue 190489), about one exit in five here. Nothing is left to flush but stdio."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
