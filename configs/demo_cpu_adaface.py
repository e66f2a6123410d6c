"""The demo with the AdaFace margin: `python scripts/demo.py --config configs/demo_cpu_adaface.py`.

Everything as configs/demo_cpu.py (tiny backbone, the same synthetic identities and verification pairs,
2 CPU ranks, Partial FC sampling half the class centres, AdamW, 1,000 steps in bf16) except the margin: AdaFace with
m = 0.2, the demo's CosFace margin (at average image quality, q = 0, AdaFace's target logit is exactly
CosFace's s * (cos(theta) - m); sharper images get more, blurrier ones less), the paper's h and t_alpha (the
defaults of configs/base.py) and its exact gradient.
"""
from easydict import EasyDict as edict

base = "demo_cpu"  # every value of configs/demo_cpu.py, then these
config = edict()
config.margin = "adaface"
config.adaface_m = 0.2
config.margin_gradient = "exact"
# AdaFace does not use margin_list, but the fingerprint does: base's value, as this recipe had before it built on
# demo_cpu (whose CosFace margin it would inherit), so its checkpoints still resume.
config.margin_list = (1.0, 0.5, 0.0)
config.output = "work_dirs/demo_adaface"
