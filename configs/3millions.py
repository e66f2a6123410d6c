"""CosFace (m3 = 0.4), MobileFaceNet on synthetic data with Partial FC sampling 0.1, 512 images per GPU, SGD lr 0.1,
weight decay 5e-4, 30 epochs, fp16 (arcface_torch's 3millions).

The speed-test recipe: no real data and no verification. The recipe writes `warmup_epoch = -1`, which our loader
refuses; arcface_torch's current scheduler never enters its warm-up branch for a negative warm-up and decays
linearly from the peak at step 0, exactly as with no warm-up, so this file keeps the default `warmup_epoch = 0`
(tests/test_recipes.py compares the two schedules step by step). `rec = "synthetic"` is the default of
configs/base.py; `num_image = 100000` is the reference's default, written here (ours is None: from the data)."""
from easydict import EasyDict as edict

config = edict()
config.margin_list = (1.0, 0.0, 0.4)
config.network = "mbf"
config.sample_rate = 0.1
config.fp16 = True
config.batch_size = 512
config.num_classes = 300000
config.num_image = 100000
config.num_epoch = 30
config.val_targets = []
