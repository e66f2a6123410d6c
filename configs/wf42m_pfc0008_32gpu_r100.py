"""CosFace (m3 = 0.4), IResNet-100 on WebFace42M with positive-only Partial FC, 512 images per GPU on 32 GPUs (global
batch 16384), SGD lr 0.4, weight decay 5e-4, 20 epochs with 2 of warm-up, fp16 (arcface_torch's
wf42m_pfc0008_32gpu_r100).

The recipe writes `sample_rate = 0`, which our config loader refuses. arcface_torch's Partial FC then samples int(0
x C_local) = 0 centres, fewer than the batch's own classes, so each rank keeps exactly the class centres of the
identities in the global batch (about 0.008 of its classes at 32 GPUs x 512 images: the `pfc0008` of the name). Our
Partial FC does the same whenever int(sample_rate x C_local) is 0, which 1e-7 guarantees at any number of ranks
(C_local <= 2,059,906 < 10^7); tests/test_recipes.py checks that only the batch's classes are used."""
from easydict import EasyDict as edict

config = edict()
config.margin_list = (1.0, 0.0, 0.4)
config.network = "r100"
config.sample_rate = 1e-7
config.fp16 = True
config.lr = 0.4
config.batch_size = 512
config.rec = "/train_tmp/WebFace42M"
config.num_classes = 2059906
config.num_image = 42474557
config.warmup_epoch = 2
