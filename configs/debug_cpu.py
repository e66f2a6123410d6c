"""A seconds-long CPU run for tests and first contact: the `tiny` backbone on synthetic data.

64 classes, 256 images, 8 images per rank (32 steps per epoch on one rank, 16 on two), 40 steps, Partial FC
sampling 0.5, resumable checkpoints every 5 steps (the two newest kept).
"""
from easydict import EasyDict as edict

config = edict()
config.network = "tiny"
config.network_kwargs = {"widths": (8, 16, 16, 32)}
config.embedding_size = 32
config.sample_rate = 0.5
config.batch_size = 8
config.num_classes = 64
config.num_image = 256
config.max_steps = 40
config.val_targets = []
config.frequent = 5
config.num_workers = 0
config.device = "cpu"
config.output = "work_dirs/debug_cpu"
config.save_every_steps = 5
