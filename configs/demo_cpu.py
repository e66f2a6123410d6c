"""`make demo`: the tiny backbone on synthetic identities, 2 CPU ranks, a few minutes.

Data: 500 generated identities x 16 images in the insightface RecordIO layout, plus syn_easy / syn_hard
verification pairs of 1,200 pairs each from identities not in training (scripts/make_synthetic.py writes
them into `rec`). CosFace margin, AdamW, Partial FC sampling half the class centres per step, verification
every 400 steps on rank 0 (scripts/demo.py then verifies the final model offline).
"""
from easydict import EasyDict as edict

config = edict()
config.network = "tiny"
config.network_kwargs = {"widths": (8, 16, 32, 64)}
config.embedding_size = 128
config.margin_list = (1.0, 0.0, 0.2)
config.margin_scale = 32.0
config.sample_rate = 0.5
config.optimizer = "adamw"
config.lr = 0.002
config.weight_decay = 0.1
config.batch_size = 32
config.rec = "data/demo_synthetic"
config.num_classes = 500
config.num_image = 8000
config.num_epoch = 1
config.max_steps = 700
config.val_targets = ["syn_easy", "syn_hard"]
config.verbose = 400
config.num_workers = 1
config.device = "cpu"
config.output = "work_dirs/demo"
config.save_every_steps = 100
