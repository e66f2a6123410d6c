"""Faces in raw photos: reading any photo, detecting faces with five landmarks, and aligning them to the ArcFace
112x112 template, as the training data and the verification sets are aligned.

``read_photo`` (``alignment.photos``) turns a file into an RGB uint8 tensor or one ``PhotoError`` naming what is
wrong; ``FaceDetector`` (``alignment.detect``) finds faces and their landmarks in batches (MTCNN from the optional
``facenet-pytorch``); ``similarity_transform`` and ``warp_to_template`` (``alignment.template``) fit and apply the
5-point similarity transform. ``align_photo`` puts the three together for one photo (``scripts/inference.py
--align``, ``scripts/compare.py``); ``scripts/prepare_faces.py`` runs them over a folder of photos.
"""
from alignment.detect import DetectorUnavailable, Face, FaceDetector, choose_faces, detection_scale
from alignment.photos import PhotoError, read_photo, read_photo_bytes, register_plugins
from alignment.policy import (
    LARGEST,
    MULTI,
    Decision,
    FacePolicy,
    add_policy_options,
    check_policy_options,
    decide,
    detector_for,
)
from alignment.template import ARCFACE_TEMPLATE, CROP_SIZE, align_face, similarity_transform, warp_to_template

__all__ = ["ARCFACE_TEMPLATE", "CROP_SIZE", "LARGEST", "MULTI", "Decision", "DetectorUnavailable", "Face",
           "FaceDetector", "FacePolicy", "PhotoError", "add_policy_options", "align_face", "align_photo",
           "check_policy_options", "choose_faces", "decide", "detection_scale", "detector_for", "read_photo",
           "read_photo_bytes", "register_plugins", "similarity_transform", "warp_to_template"]


def align_photo(path, detector: FaceDetector, policy: FacePolicy = LARGEST):
    """``(crop, decision)``: the aligned (3, 112, 112) uint8 crop of the face ``policy`` keeps in the photo at
    ``path`` (by default the largest face nearest the centre, of those above its thresholds) and the decision,
    which says how many faces counted and why others did not. ``detector`` reports every face (``detector_for``).
    ``PhotoError`` naming the file when it cannot be read or no face counts, saying why (none found, the largest
    below ``--min-face-size``, the best below ``--min-score``)."""
    image = read_photo(path)
    decision = decide(detector.detect([image])[0], tuple(image.shape[1:]), policy)
    if not decision.keep:
        raise PhotoError(f"{path}: {decision.reason}")
    return align_face(image, decision.keep[0].points), decision
