"""The PyTorch side of `cargo xtask headline`: a reproducible random Qwen3 checkpoint and
batches, and its training trajectory under PyTorch FSDP2 (gloo, CPU).

  python3 scripts/headline.py init DIR [--seed S] [--world W] [--batch B] [--seq T] [--steps N] [--lr LR]
  python3 -m torch.distributed.run --nproc-per-node W scripts/headline.py fsdp DIR --out NAME

`init` reads DIR/config.json (an HF Qwen3 config, written by `cargo xtask headline`) and writes
  DIR/model.safetensors    fp32 weights of Qwen3ForCausalLM(config) after torch.manual_seed(S)
                           (HF's own initialisation; no lm_head.weight when tied)
  DIR/batches.safetensors  `tokens` [N, W*B, T+1] int64: a learnable synthetic language,
                           next = (5 * cur + 11) mod V with probability 0.8, else uniform
  DIR/train.json           the run: world, batch, seq, steps, AdamW settings
  DIR/sha256.json          SHA-256 of the two safetensors files (the weights are not kept in
                           the repository: these say whether a regenerated set is the same)
`fsdp` trains with fully_shard on every decoder layer, then the root, MixedPrecisionPolicy()
(fp32), AdamW (PyTorch's, decoupled weight decay), no clipping (the norm is still measured),
and writes DIR/NAME.json: per step the loss (mean token cross-entropy over the global batch,
before the update) and the global gradient norm, plus the wall time.
"""
import argparse
import hashlib
import json
import os
import sys
import time

try:
    import torch
    import torch.distributed as dist
    from safetensors.torch import load_file, save_file
    from transformers import Qwen3Config, Qwen3ForCausalLM
except ImportError as e:
    sys.exit(f"headline.py: {e}: {sys.executable} needs torch, transformers and safetensors "
             "(pip install torch transformers safetensors), or pass another --python")

parser = argparse.ArgumentParser()
parser.add_argument("cmd", choices=["init", "fsdp"])
parser.add_argument("dir")
parser.add_argument("--seed", type=int, default=0)
parser.add_argument("--world", type=int, default=4)
parser.add_argument("--batch", type=int, default=2)
parser.add_argument("--seq", type=int, default=128)
parser.add_argument("--steps", type=int, default=20)
parser.add_argument("--lr", type=float, default=3e-4)
parser.add_argument("--out", default="torch_fsdp4")
args = parser.parse_args()
torch.set_num_threads(1)
torch.use_deterministic_algorithms(True)


def sha256(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 24), b""):
            h.update(block)
    return h.hexdigest()


def build(config):
    config._attn_implementation = "eager"
    return Qwen3ForCausalLM(config).float()


if args.cmd == "init":
    config = Qwen3Config.from_pretrained(args.dir)
    torch.manual_seed(args.seed)
    model = build(config)
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    if config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    save_file(state, os.path.join(args.dir, "model.safetensors"), metadata={"format": "pt"})
    del model, state
    gen = torch.Generator().manual_seed(args.seed + 1)
    vocab = config.vocab_size
    rows = args.world * args.batch
    tokens = torch.empty(args.steps, rows, args.seq + 1, dtype=torch.int64)
    tokens[..., 0] = torch.randint(0, vocab, (args.steps, rows), generator=gen)
    for t in range(1, args.seq + 1):
        follow = (5 * tokens[..., t - 1] + 11) % vocab
        noise = torch.randint(0, vocab, (args.steps, rows), generator=gen)
        keep = torch.rand((args.steps, rows), generator=gen) < 0.8
        tokens[..., t] = torch.where(keep, follow, noise)
    save_file({"tokens": tokens}, os.path.join(args.dir, "batches.safetensors"))
    train = dict(world=args.world, batch=args.batch, seq=args.seq, steps=args.steps, seed=args.seed,
                 optimizer="AdamW", lr=args.lr, betas=[0.9, 0.95], eps=1e-8, weight_decay=0.1,
                 torch=torch.__version__)
    json.dump(train, open(os.path.join(args.dir, "train.json"), "w"), indent=2)
    sums = {name: sha256(os.path.join(args.dir, name)) for name in ["model.safetensors", "batches.safetensors"]}
    json.dump(sums, open(os.path.join(args.dir, "sha256.json"), "w"), indent=2)
    print(json.dumps(sums, indent=2))
    sys.exit(0)

train = json.load(open(os.path.join(args.dir, "train.json")))
tokens = load_file(os.path.join(args.dir, "batches.safetensors"))["tokens"]
dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
rows = tokens.shape[1]
if rows % world:
    sys.exit(f"{rows} rows per step do not split over {world} ranks")
per_rank = rows // world

from torch.distributed.device_mesh import init_device_mesh  # noqa: E402
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard  # noqa: E402

config = Qwen3Config.from_pretrained(args.dir)
# FSDP2's recommended initialisation for a model larger than a process should hold: build it on
# the meta device, shard it, allocate the shards, and let rank 0 read the checkpoint and
# broadcast each tensor (each rank keeps its shard). No process holds a second full copy.
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict  # noqa: E402

with torch.device("meta"):
    model = build(config)
mesh = init_device_mesh("cpu", (world,))
for layer in model.model.layers:
    fully_shard(layer, mesh=mesh, mp_policy=MixedPrecisionPolicy())
fully_shard(model, mesh=mesh, mp_policy=MixedPrecisionPolicy())
model.to_empty(device="cpu")
weights = load_file(os.path.join(args.dir, "model.safetensors")) if rank == 0 else {}
if rank == 0:
    names = set(model.state_dict().keys())
    missing = names - set(weights) - ({"lm_head.weight"} if config.tie_word_embeddings else set())
    if missing or set(weights) - names:
        sys.exit(f"checkpoint mismatch: missing {sorted(missing)}, unexpected {sorted(set(weights) - names)}")
set_model_state_dict(model, weights, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True,
                                                               strict=False))
del weights
# The rotary tables are buffers computed at construction, not weights: rebuild them.
model.model.rotary_emb = type(model.model.rotary_emb)(config=config)
optim = torch.optim.AdamW(model.parameters(), lr=train["lr"], betas=tuple(train["betas"]), eps=train["eps"],
                          weight_decay=train["weight_decay"])
losses, norms, seconds = [], [], []
for step in range(tokens.shape[0]):
    start = time.time()
    batch = tokens[step][rank * per_rank:(rank + 1) * per_rank]
    logits = model(input_ids=batch[:, :-1]).logits.float()
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)), batch[:, 1:].reshape(-1))
    loss.backward()
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), float("inf"))
    if hasattr(norm, "full_tensor"):
        norm = norm.full_tensor()
    optim.step()
    optim.zero_grad(set_to_none=True)
    total = loss.detach().clone()
    dist.all_reduce(total)
    total /= world
    losses.append(total.item())
    norms.append(float(norm))
    seconds.append(time.time() - start)
    if rank == 0:
        print(f"torch fsdp step {step:2d} loss {losses[-1]:.8f} grad norm {norms[-1]:.6f} ({seconds[-1]:.1f} s)",
              flush=True)
if rank == 0:
    out = dict(mode="fsdp2", world=world, losses=losses, grad_norms=norms, step_seconds=seconds,
               torch=torch.__version__)
    json.dump(out, open(os.path.join(args.dir, f"{args.out}.json"), "w"), indent=2)
dist.destroy_process_group()
