"""From a folder of raw photos to a training set: the library of ``scripts/prepare_faces.py``.

- ``photos.listing``: the photos (the identity-folder rule of ``dataset.identity_folders``, every format Pillow
  reads, or a list file), their order, and landmarks a user gives;
- ``photos.pipeline``: read, detect (``alignment``) and align each photo not detected yet;
- ``photos.work``: the work folder that keeps every photo's detections, by content and detector settings;
- ``photos.policy``: which detected faces a photo keeps, and why (``decide``), apart from the detections;
- ``photos.matching``: who is who, with a recognition model (``eval``): a group photo's face, mislabelled photos;
- ``photos.duplicates``: copies of one photo;
- ``photos.holdout``: the held-out identities and their verification pairs;
- ``photos.report``: ``report.csv`` and ``preview.png``;
- ``photos.pack``: the output folder, written through ``utils.files.staged`` (``dataset`` writes the rec and
  the ``.bin``);
- ``photos.prepare``: all of it, from the input to the output (``prepare``).

This package imports ``alignment``, ``dataset``, ``eval`` and ``utils``; what it leaves out it logs (the
``photos`` logger, which the tool prints as its lines). The user's manual is docs/data.md ("From your own
photos").
"""
