"""Backbone throughput: training images/s (forward, backward, SGD step) and inference images/s.

    python bench/backbone.py --network r50 --batch-size 64 [--channels-last] [--bf16] [--compile] [--device cuda]

Prints a markdown table with the model's multiply-adds per image and the achieved FLOP rate (training
counts 3x the forward: forward, input gradient, weight gradient); on a GPU whose peak is known it also
prints the MFU (model FLOPs utilisation) against the datasheet peak and against the bf16 matrix-product rate
measured in the same run. ``--json PATH`` writes the same numbers.
"""
from __future__ import annotations

import argparse
import json
from contextlib import nullcontext

import torch
from common import markdown_table, time_call, write_json

# Dense bf16 tensor-core peak in TFLOP/s, for the MFU column (published datasheet figures).
PEAK_BF16_TFLOPS = {"H200": 989.0, "H100": 989.0, "A100": 312.0}


def peak_tflops(device: torch.device) -> float | None:
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((v for k, v in PEAK_BF16_TFLOPS.items() if k in name), None)


def bf16_matmul_tflops(device: torch.device, n: int = 8192, repeats: int = 20) -> float | None:
    """The bf16 matrix-product rate this GPU reaches now (n x n x n products), in TFLOP/s: the ceiling that
    ``mfu_measured`` divides by (a datasheet peak is rarely reachable). None off CUDA."""
    if device.type != "cuda":
        return None
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    timing = time_call(lambda: torch.mm(a, b), repeats=repeats, warmup=3, sync=torch.cuda.synchronize)
    return 2 * n ** 3 / timing.median / 1e12


def run(network: str, batch_size: int, device: torch.device, channels_last: bool, bf16: bool, compile_: bool,
        repeats: int, warmup: int, embedding_size: int = 512, image_size: int = 112,
        network_kwargs: dict | None = None) -> dict:
    from backbones import get_model
    from backbones.flops import count_flops
    from utils.precision import configure_cuda

    configure_cuda(device, tf32=True, cudnn_benchmark=True)  # as the trainer runs with its defaults
    model = get_model(network, num_features=embedding_size, **(network_kwargs or {}))
    params, macs = count_flops(model, image_size)
    model = model.to(device)
    memory_format = torch.channels_last if channels_last else torch.contiguous_format
    model = model.to(memory_format=memory_format)
    step_model = torch.compile(model) if compile_ else model
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9, weight_decay=5e-4)
    images = (torch.rand(batch_size, 3, image_size, image_size, device=device) * 2 - 1).contiguous(
        memory_format=memory_format)
    autocast = torch.autocast(device.type, dtype=torch.bfloat16) if bf16 else nullcontext()
    sync = torch.cuda.synchronize if device.type == "cuda" else None

    def train_step() -> None:
        with autocast:
            embeddings = step_model(images)
        # A stand-in loss: the backbone's cost does not depend on which loss sits on top.
        embeddings.float().pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    @torch.no_grad()
    def infer() -> None:
        with autocast:
            step_model(images)

    model.train()
    train = time_call(train_step, repeats=repeats, warmup=warmup, sync=sync)
    model.eval()
    inference = time_call(infer, repeats=repeats, warmup=warmup, sync=sync)
    train_ips = batch_size / train.median
    infer_ips = batch_size / inference.median
    # 2 FLOPs per multiply-add; training = forward + input-gradient + weight-gradient, 3 forwards' worth.
    train_tflops = 3 * 2 * macs * train_ips / 1e12
    peak = peak_tflops(device)
    measured = bf16_matmul_tflops(device)
    return {
        "network": network, "batch_size": batch_size, "device": str(device), "channels_last": channels_last,
        "bf16": bf16, "compile": compile_, "params": params, "gmacs_per_image": macs / 1e9,
        "train_images_per_s": train_ips, "train_step": train.as_dict(),
        "infer_images_per_s": infer_ips, "infer_step": inference.as_dict(),
        "train_tflops": train_tflops, "mfu": train_tflops / peak if peak else None,
        "bf16_matmul_tflops": measured, "mfu_measured": train_tflops / measured if measured else None,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--network", default="r50")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--channels-last", action="store_true")
    parser.add_argument("--bf16", action="store_true")
    parser.add_argument("--compile", action="store_true", help="torch.compile the backbone")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0 = torch's default)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--embedding-size", type=int, default=512)
    parser.add_argument("--network-kwargs", default="{}", help="JSON of extra backbone arguments")
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    result = run(args.network, args.batch_size, torch.device(args.device), args.channels_last, args.bf16,
                 args.compile, args.repeats, args.warmup, args.embedding_size,
                 network_kwargs=json.loads(args.network_kwargs))
    t, i = result["train_step"], result["infer_step"]
    rows = [[result["network"], result["device"], args.batch_size,
             "+".join(n for n, on in (("channels_last", args.channels_last), ("bf16", args.bf16),
                                      ("compile", args.compile)) if on) or "fp32",
             f"{result['gmacs_per_image']:.3f}",
             f"{result['train_images_per_s']:.1f} "
             f"({args.batch_size / t['max_s']:.1f}-{args.batch_size / t['min_s']:.1f})",
             f"{result['infer_images_per_s']:.1f} "
             f"({args.batch_size / i['max_s']:.1f}-{args.batch_size / i['min_s']:.1f})",
             f"{result['train_tflops']:.3f}", f"{result['mfu']:.1%}" if result["mfu"] else "-",
             f"{result['mfu_measured']:.1%} of {result['bf16_matmul_tflops']:.0f}" if result["mfu_measured"] else "-"]]
    print(markdown_table(["network", "device", "batch", "options", "GMACs/img", "train img/s (range)",
                          "infer img/s (range)", "train TFLOP/s", "MFU (datasheet)", "MFU (measured bf16 TFLOP/s)"],
                         rows))
    write_json(args.json, {"backbone": result})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
