"""CosFace (m3 = 0.4), IResNet-50 on WebFace42M with Partial FC sampling 0.2, 8 GPUs x 512 images (global batch
4096), lr 0.4 with 2 warm-up epochs, fp16. arcface_torch has no file of this exact name: these are the values of
its 8-GPU IResNet-50 WebFace42M recipe (wf42m_pfc02_8gpus_r50_bs4k)."""
from easydict import EasyDict as edict

config = edict()
config.margin_list = (1.0, 0.0, 0.4)
config.sample_rate = 0.2
config.fp16 = True
config.batch_size = 512
config.lr = 0.4
config.verbose = 10000
config.rec = "/train_tmp/WebFace42M"
config.num_classes = 2059906
config.num_image = 42474557
config.warmup_epoch = 2
