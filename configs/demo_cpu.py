"""`make demo`: the tiny backbone on synthetic identities, 2 CPU ranks, a few minutes.

Data: 500 generated identities x 16 images in the insightface RecordIO layout, plus syn_easy / syn_hard
verification pairs of 1,200 pairs each from identities not in training (scripts/make_synthetic.py writes
them into `rec`). The tiny IResNet with 2 channels at full resolution and 8, 16, 32 in the smaller stages (a
wider first stage costs more per core than it gives: bench/README.md, "Backbones"), a 256-d embedding, CosFace
margin, AdamW, Partial FC sampling half the class centres per step, 1,000 steps in bf16 (scripts/demo.py switches
to fp32 on a CPU without hardware bf16). No verification during training (base's verbose = 2000 is past the last
step): scripts/demo.py verifies the final model offline, beside the untrained one.
"""
from easydict import EasyDict as edict

config = edict()
config.network = "tiny"
config.network_kwargs = {"widths": (2, 8, 16, 32)}
config.embedding_size = 256
config.margin_list = (1.0, 0.0, 0.2)
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
config.output = "work_dirs/demo"
config.save_every_steps = 100
