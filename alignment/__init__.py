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
from alignment.template import ARCFACE_TEMPLATE, CROP_SIZE, align_face, similarity_transform, warp_to_template

__all__ = ["ARCFACE_TEMPLATE", "CROP_SIZE", "DetectorUnavailable", "Face", "FaceDetector", "PhotoError",
           "align_face", "align_photo", "choose_faces", "detection_scale", "read_photo", "read_photo_bytes",
           "register_plugins", "similarity_transform", "warp_to_template"]


def align_photo(path, detector: FaceDetector, multi: str = "largest"):
    """The aligned (3, 112, 112) uint8 crop of the face ``choose_faces`` picks in the photo at ``path``
    (``multi = "largest"``: the largest face nearest the centre); raises ``PhotoError`` when the photo cannot be
    read or holds no face."""
    image = read_photo(path)
    faces = choose_faces(detector.detect([image])[0], image.shape[1:], multi=multi)
    if not faces:
        raise PhotoError(f"{path}: no face found (detector score threshold {detector.min_score:g}, minimum face size "
                         f"{detector.min_face_size:g} px)")
    return align_face(image, faces[0].points)
