"""The demo with the AdaFace margin: `python scripts/demo.py --config configs/demo_cpu_adaface.py`.

Everything as configs/demo_cpu.py (tiny backbone, the same synthetic identities and verification pairs,
2 CPU ranks, Partial FC sampling half the class centres, AdamW, 1,000 steps in bf16) except the margin: AdaFace with
m = 0.2, the demo's CosFace margin (at average image quality, q = 0, AdaFace's target logit is exactly
CosFace's s * (cos(theta) - m); sharper images get more, blurrier ones less), the paper's h and t_alpha (the
defaults of configs/base.py) and its exact gradient.
"""
from easydict import EasyDict as edict

config = edict()
config.network = "tiny"
config.network_kwargs = {"widths": (2, 8, 16, 32)}
config.embedding_size = 256
config.margin = "adaface"
config.adaface_m = 0.2
config.margin_gradient = "exact"
config.margin_scale = 32.0
config.sample_rate = 0.5
config.optimizer = "adamw"
config.lr = 0.002
config.weight_decay = 0.1
config.bf16 = True
config.batch_size = 32
config.rec = "data/demo_synthetic"
config.num_classes = 500
config.num_image = 8000
config.num_epoch = 1
config.max_steps = 1000
config.val_targets = ["syn_easy", "syn_hard"]
# Images decoded in the rank itself: with 2 ranks on 2 cores a loader process per rank only competes with them
# for the cores (the same batches, slower; bench/README.md).
config.num_workers = 0
config.device = "cpu"
config.output = "work_dirs/demo_adaface"
config.save_every_steps = 100
