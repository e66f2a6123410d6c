"""Train an r50 from scratch on your own aligned faces in a folder per identity (README, "Train on real data").

Copy this file, point `rec` at the folder and start it:

    cp configs/image_folder_r50.py configs/my_faces.py         # then set config.rec = "/data/faces"
    python scripts/rec_info.py /data/faces --check               # every image decodes; identities with few images
    torchrun --nproc_per_node=2 train.py configs/my_faces

The folder holds `<identity>/<image>.jpg` (or .png), 112x112 faces aligned to the ArcFace template, as
scripts/prepare_faces.py writes them from raw photos (its train.rec folder works here too). num_classes and
num_image are base's None: the trainer reads them from the folder (one class per identity folder, every image) and
logs where each number came from. Every other key is base's (configs/base.py), the ms1mv3_r50 recipe's choices:
r50, ArcFace margin, sample rate 1, SGD at lr 0.1 for 20 epochs, batch 128 per GPU.
"""
from easydict import EasyDict as edict

config = edict()
config.rec = "/data/faces"
config.warmup_epoch = 1
config.val_targets = []
config.output = "work_dirs/image_folder_r50"
