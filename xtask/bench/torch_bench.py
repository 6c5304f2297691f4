"""PyTorch side of `cargo xtask bench`: the same Qwen3 in transformers, timed on the CPU.

Builds `Qwen3ForCausalLM` from a `config.json` (written by the bench from the same
`Qwen3Config` the Burn side uses), fp32, random init, and times

* forward: logits of a `[batch, seq]` batch under `torch.inference_mode()`;
* training step: forward on `[batch, seq]` inputs, next-token cross-entropy against the
  following tokens (as `qwen3_burn::train::{inputs_and_labels, cross_entropy}`), backward,
  gradient-norm computation (as Burn's `clip_grad_norm`, which always computes the norm) and
  an AdamW step,

after `--warmup` untimed iterations, on `--threads` intra-op threads. Prints one JSON line.

`--train-only` skips the forward timing. `--fsdp-world N` times the training step under
PyTorch FSDP2 instead: N processes (gloo), `fully_shard` on every decoder layer and then the
root, each rank on its own `--batch` rows, rank r pinned to the r-th core this process may
use; the reported tokens/s counts all ranks' tokens.
"""

import argparse
import json
import os
import time


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--config", required=True, help="directory or path of config.json")
    p.add_argument("--batch", type=int, required=True)
    p.add_argument("--seq", type=int, required=True)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--train-only", action="store_true")
    p.add_argument("--fsdp-world", type=int, default=0)
    a = p.parse_args()
    if a.fsdp_world > 0:
        import socket

        import torch.multiprocessing as mp

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        cores = sorted(os.sched_getaffinity(0))
        mp.spawn(run, args=(a, port, cores), nprocs=a.fsdp_world, join=True)
    else:
        run(None, a, None, None)


def run(rank, a, port, cores) -> None:

    import torch
    import transformers
    from transformers import Qwen3Config, Qwen3ForCausalLM

    world = 1
    if rank is not None:
        import torch.distributed as dist

        os.sched_setaffinity(0, {cores[rank % len(cores)]})
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        dist.init_process_group("gloo", rank=rank, world_size=a.fsdp_world)
        world = a.fsdp_world
    torch.set_num_threads(a.threads)
    torch.manual_seed(a.seed)
    path = a.config if a.config.endswith(".json") else a.config.rstrip("/") + "/config.json"
    with open(path) as f:
        cfg = json.load(f)
    config = Qwen3Config(**cfg)
    model = Qwen3ForCausalLM(config).to(torch.float32)
    model.config.use_cache = False
    params = sum(t.numel() for t in model.parameters())  # tied weights counted once
    vocab = config.vocab_size
    # seq + 1 tokens per row: inputs are the first seq, labels the last seq.
    gen = torch.Generator().manual_seed(a.seed + (rank or 0))
    tokens = torch.randint(0, vocab, (a.batch, a.seq + 1), generator=gen)
    inputs, labels = tokens[:, :-1], tokens[:, 1:]
    n_tokens = a.batch * a.seq * world

    fwd = None
    if not a.train_only and rank is None:
        model.eval()
        with torch.inference_mode():
            for _ in range(a.warmup):
                model(input_ids=inputs).logits
            start = time.perf_counter()
            for _ in range(a.steps):
                model(input_ids=inputs).logits
            fwd = time.perf_counter() - start
    if rank is not None:
        from torch.distributed.fsdp import fully_shard

        for layer in model.model.layers:
            fully_shard(layer)
        fully_shard(model)

    model.train()
    # Burn's training has no dropout either; Qwen3's attention dropout is 0.
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0)

    def step() -> None:
        optim.zero_grad(set_to_none=True)
        logits = model(input_ids=inputs).logits
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, vocab).float(), labels.reshape(-1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), float("inf"))
        optim.step()

    for _ in range(a.warmup):
        step()
    if rank is not None:
        dist.barrier()
    start = time.perf_counter()
    for _ in range(a.steps):
        step()
    if rank is not None:
        dist.barrier()
    train = time.perf_counter() - start
    if rank is not None:
        dist.destroy_process_group()
        if rank != 0:
            return

    print(
        json.dumps(
            {
                "torch_version": torch.__version__,
                "transformers_version": transformers.__version__,
                "threads": torch.get_num_threads(),
                "attn_implementation": getattr(model.config, "_attn_implementation", None),
                "params": params,
                "batch": a.batch,
                "seq": a.seq,
                "steps": a.steps,
                "fsdp_world": world if rank is not None else None,
                "forward_tokens_per_sec": n_tokens * a.steps / fwd if fwd else None,
                "train_step_tokens_per_sec": n_tokens * a.steps / train,
            }
        )
    )


if __name__ == "__main__":
    main()
