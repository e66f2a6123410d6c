"""alignment/: the similarity fit, the warp, reading any photo, and detection + alignment of a real face.

The real face is scikit-image's astronaut photo (512x512, one face). It is moved by known similarity transforms
(rotation, scale, translation, mirror, JPEG re-encoding, pasted beside a second smaller face), made with Pillow,
not with our warp; after detection and alignment each copy must give the original's aligned crop.
"""
from __future__ import annotations

import io

import numpy as np
import pytest
import torch

from alignment import ARCFACE_TEMPLATE, PhotoError, align_face, choose_faces, read_photo, similarity_transform
from alignment.detect import Face
from alignment.template import apply_transform, warp_to_template

pytestmark = pytest.mark.timeout(120)


def _similarity(angle_deg: float, scale: float, tx: float, ty: float) -> np.ndarray:
    a = np.deg2rad(angle_deg)
    return np.array([[scale * np.cos(a), -scale * np.sin(a), tx], [scale * np.sin(a), scale * np.cos(a), ty]])


def test_the_fit_recovers_a_known_similarity():
    rng = np.random.default_rng(0)
    for _ in range(20):
        truth = _similarity(rng.uniform(-180, 180), rng.uniform(0.2, 5), *rng.uniform(-300, 300, 2))
        src = rng.uniform(0, 500, (5, 2))
        fitted = similarity_transform(src, apply_transform(truth, src))
        assert np.abs(apply_transform(fitted, src) - apply_transform(truth, src)).max() < 0.01
        np.testing.assert_allclose(fitted, truth, atol=1e-8)
    # A mirrored set of points is fitted by a rotation, never a reflection: the determinant stays positive.
    src = rng.uniform(0, 100, (5, 2))
    fitted = similarity_transform(src, src * [-1, 1])
    assert np.linalg.det(fitted[:, :2]) > 0
    with pytest.raises(ValueError, match=r"two \(K, 2\) point sets"):
        similarity_transform(src, src[:4])
    with pytest.raises(ValueError, match="all the same point"):
        similarity_transform(np.ones((5, 2)), src)


def test_the_warp_samples_the_photo_at_the_inverse_transform():
    g = torch.Generator().manual_seed(0)
    photo = torch.randint(0, 256, (3, 200, 240), generator=g, dtype=torch.uint8)
    # A translation by whole pixels is a slice; half a pixel is the mean of neighbours (bilinear).
    crop = warp_to_template(photo, np.array([[1.0, 0, -30], [0, 1, -50]]))
    assert torch.equal(crop, photo[:, 50:162, 30:142])
    half = warp_to_template(photo, np.array([[1.0, 0, -30.5], [0, 1, -50]]))
    expected = (photo[:, 50:162, 30:142].double() + photo[:, 50:162, 31:143].double()) / 2
    assert (half.double() - expected).abs().max() <= 0.5 + 1e-9
    # Beyond the photo the crop is black.
    edge = warp_to_template(photo, np.array([[1.0, 0, 0], [0, 1, 0]]) + np.array([[0, 0, -200], [0, 0, 0]]))
    assert torch.equal(edge[:, :, 40:], torch.zeros_like(edge[:, :, 40:]))
    assert torch.equal(edge[:, :, :40], photo[:, :112, 200:240])
    with pytest.raises(ValueError, match="uint8"):
        warp_to_template(photo.float(), np.eye(2, 3))


def test_template_points_land_on_the_template():
    """A photo whose landmarks are the template moved by a similarity: the crop puts them back exactly (the
    alignment of a synthetic pattern drawn at those points)."""
    truth = _similarity(20, 2.5, 100, 40)
    points = apply_transform(np.linalg.inv(np.vstack([truth, [0, 0, 1]]))[:2], ARCFACE_TEMPLATE)
    np.testing.assert_allclose(apply_transform(similarity_transform(points, ARCFACE_TEMPLATE), points),
                               ARCFACE_TEMPLATE, atol=1e-9)


# ---------------------------------------------------------------------------------------------- reading photos

def _save(image, fmt: str, **options) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, fmt, **options)
    return buffer.getvalue()


def test_read_photo_makes_every_mode_upright_rgb(tmp_path):
    from PIL import Image

    rgb = Image.new("RGB", (40, 30), (200, 100, 50))
    rgb.paste((0, 0, 255), (0, 0, 10, 10))  # a blue corner, top left
    cases = {
        "plain.png": (_save(rgb, "PNG"), (30, 40), (0, 0, 255)),
        "gray.jpg": (_save(rgb.convert("L"), "JPEG", quality=100), (30, 40), None),
        "cmyk.jpg": (_save(rgb.convert("CMYK"), "JPEG", quality=100), (30, 40), None),
        "palette.gif": (_save(rgb.convert("P"), "GIF"), (30, 40), None),
        "webp.webp": (_save(rgb, "WEBP", lossless=True), (30, 40), (0, 0, 255)),
        "bmp.bmp": (_save(rgb, "BMP"), (30, 40), (0, 0, 255)),
    }
    exif = Image.Exif()
    exif[0x0112] = 6  # orientation: rotate 90° clockwise to show
    cases["rotated.jpg"] = (_save(rgb, "JPEG", quality=100, exif=exif), (40, 30), None)
    alpha = Image.new("RGBA", (40, 30), (255, 0, 0, 0))  # fully transparent: white once composited
    cases["alpha.png"] = (_save(alpha, "PNG"), (30, 40), (255, 255, 255))
    sixteen = Image.fromarray(np.full((30, 40), 65535, dtype=np.uint16))
    cases["sixteen.png"] = (_save(sixteen, "PNG"), (30, 40), (255, 255, 255))
    for name, (data, size, corner) in cases.items():
        (tmp_path / name).write_bytes(data)
        photo = read_photo(tmp_path / name)
        assert photo.dtype == torch.uint8 and photo.shape == (3, *size), (name, photo.shape)
        if corner is not None:
            assert tuple(photo[:, 0, 0].tolist()) == corner, (name, photo[:, 0, 0])
    # The EXIF orientation is applied: the blue corner, top left when stored, is top right when shown.
    rotated = read_photo(tmp_path / "rotated.jpg")
    assert rotated[2, 2, -3] > 200 and rotated[2, 2, 2] < 100


def test_read_photo_names_the_file_and_the_problem(tmp_path):
    from PIL import Image

    good = _save(Image.new("RGB", (64, 64), (10, 20, 30)), "JPEG")
    (tmp_path / "empty.jpg").write_bytes(b"")
    (tmp_path / "text.jpg").write_text("not a photo")
    (tmp_path / "truncated.jpg").write_bytes(good[: len(good) // 2])
    (tmp_path / "big.png").write_bytes(_save(Image.new("L", (3000, 2000)), "PNG"))
    (tmp_path / "folder.jpg").mkdir()
    expected = {"empty.jpg": "an empty file", "text.jpg": "not an image", "truncated.jpg": "cannot decode",
                "big.png": "decompression bomb", "folder.jpg": "a folder", "missing.jpg": "no such file"}
    for name, words in expected.items():
        with pytest.raises(PhotoError, match=words) as info:
            read_photo(tmp_path / name, max_pixels=5_000_000)
        assert str(info.value).startswith(str(tmp_path / name)), str(info.value)
    # The limit is max_pixels, read from the header before any pixel is decoded: 90M pixels (beyond Pillow's
    # warning at 89.5M) are refused at 80M and pass the check at the default 100M.
    header = Image.new("1", (10000, 9000))
    header.save(tmp_path / "huge.png")
    with pytest.raises(PhotoError, match="90,000,000 pixels|10000x9000 pixels is more than the 80,000,000"):
        read_photo(tmp_path / "huge.png", max_pixels=80_000_000)
    from alignment import photos

    loaded = []
    real = photos._as_rgb
    photos._as_rgb = lambda image, path: loaded.append(image.size) or np.zeros((1, 1, 3), np.uint8)
    try:
        read_photo(tmp_path / "huge.png")
    finally:
        photos._as_rgb = real
    assert loaded == [(10000, 9000)]


# ----------------------------------------------------------------------------------------- the real face

def _astronaut():
    from PIL import Image
    from skimage import data

    return Image.fromarray(data.astronaut())


def _moved(photo, matrix: np.ndarray, size: tuple[int, int]):
    """``photo`` moved by ``matrix`` (2, 3; pixel centres at integers) onto a canvas of ``size`` (W, H), by Pillow."""
    from PIL import Image

    inverse = np.linalg.inv(np.vstack([matrix, [0, 0, 1]]))  # canvas -> photo, pixel centres
    # Pillow's affine data maps canvas to photo in corner coordinates (pixel centres at +0.5).
    a = inverse[:2, :2]
    c = inverse[:2, 2] - a @ [0.5, 0.5] + 0.5
    return photo.transform(size, Image.AFFINE, data=(a[0, 0], a[0, 1], c[0], a[1, 0], a[1, 1], c[1]),
                           resample=Image.BILINEAR)


def _tensor(photo) -> torch.Tensor:
    return torch.from_numpy(np.array(photo.convert("RGB"))).permute(2, 0, 1).contiguous()


def _correlation(a: torch.Tensor, b: torch.Tensor) -> float:
    """Pearson correlation of two crops' pixel values."""
    return float(np.corrcoef(a.double().flatten().numpy(), b.double().flatten().numpy())[0, 1])


def test_a_moved_photo_gives_the_original_aligned_crop():
    pytest.importorskip("facenet_pytorch", reason="the face detector is not installed: pip install --no-deps -r "
                                                  "requirements-faces.txt")
    from PIL import Image

    from alignment import FaceDetector

    detector = FaceDetector()
    original = _astronaut()
    image = _tensor(original)
    [face] = detector.detect([image])[0]
    crop = align_face(image, face.points)
    on_template = apply_transform(similarity_transform(face.points, ARCFACE_TEMPLATE), face.points)
    cases = {
        "rotated +30": (_similarity(30, 1.0, 300, -90), (700, 700), False),
        "rotated -30": (_similarity(-30, 1.0, -40, 220), (700, 700), False),
        "half size": (_similarity(0, 0.5, 10, 20), (300, 300), False),
        "double size": (_similarity(5, 2.0, -100, -50), (900, 700), False),
        "mirrored": (np.array([[-1.0, 0, 511], [0, 1, 0]]), (512, 512), False),
        "jpeg 60": (_similarity(0, 1.0, 0, 0), (512, 512), True),
    }
    photos = {}
    for name, (matrix, size, jpeg) in cases.items():
        moved = _moved(original, matrix, size)
        if jpeg:
            moved = Image.open(io.BytesIO(_save(moved, "JPEG", quality=60)))
        photos[name] = (_tensor(moved), matrix)
    # Pasted into a larger photo beside a second, smaller copy of the face: the larger face is chosen.
    canvas = Image.new("RGB", (1200, 800), (90, 90, 90))
    canvas.paste(original, (600, 150))
    canvas.paste(original.resize((256, 256), Image.BILINEAR), (40, 400))
    photos["beside a smaller face"] = (_tensor(canvas), np.array([[1.0, 0, 600], [0, 1, 150]]))

    found = detector.detect([photo for photo, _ in photos.values()])
    correlations = {}
    for (name, (photo, matrix)), faces in zip(photos.items(), found):
        chosen = choose_faces(faces, tuple(photo.shape[1:]))
        assert len(chosen) == 1, (name, faces)
        points = chosen[0].points
        got = align_face(photo, points)
        # The original's landmarks, moved with the photo, then aligned by this copy's own fit: where the
        # original's fit put them (mirrored, for the mirrored copy).
        mapped = apply_transform(similarity_transform(points, ARCFACE_TEMPLATE), apply_transform(matrix, face.points))
        want_points, want_crop = on_template, crop
        if name == "mirrored":
            want_points = np.stack([111 - on_template[:, 0], on_template[:, 1]], axis=1)
            want_crop = crop.flip(-1)
        assert np.abs(mapped - want_points).max() <= 2.0, (name, mapped - want_points)
        assert _correlation(got, want_crop) >= 0.95, (name, _correlation(got, want_crop))
        correlations[name] = _correlation(got, want_crop)
    assert len(found[-1]) == 2  # the smaller face was found too
    # A different face (the original, shifted by a fifth of the crop) is not mistaken for the same crop.
    shifted = warp_to_template(image, np.hstack([np.eye(2), [[22.0], [22.0]]]) @ np.vstack(
        [similarity_transform(face.points, ARCFACE_TEMPLATE), [0, 0, 1]]))
    assert _correlation(shifted, crop) < min(correlations.values()) - 0.1, correlations


def test_choose_faces_policies():
    def face(x0, y0, size, score=0.99):
        return Face((x0, y0, x0 + size, y0 + size), score, np.zeros((5, 2)))

    big_corner, big_centre, small = face(0, 0, 100), face(150, 150, 95), face(300, 300, 40)
    faces = [big_corner, small, big_centre]
    assert choose_faces(faces, (400, 400), "largest") == [big_centre]  # within 10 % of the largest: nearest centre
    assert choose_faces([big_corner, small], (400, 400), "largest") == [big_corner]
    assert choose_faces(faces, (400, 400), "skip") == [] and choose_faces([small], (400, 400), "skip") == [small]
    assert choose_faces(faces, (400, 400), "all") == faces
    with pytest.raises(ValueError, match="largest, skip or all"):
        choose_faces(faces, (400, 400), "first")


# ------------------------------------------------------------------------------------------ speed's contracts

def test_a_crop_depends_only_on_the_photo_pixels_under_it():
    """The warp reads only the region under the crop (and a pixel around it): the rest of the photo can be
    anything, and a photo many times the crop's size gives the crop of that region alone."""
    g = torch.Generator().manual_seed(1)
    photo = torch.randint(0, 256, (3, 900, 1200), generator=g, dtype=torch.uint8)
    matrix = _similarity(17, 0.4, -200, -60)  # photo -> crop: a face of about 280 px, turned
    region = np.linalg.inv(np.vstack([matrix, [0, 0, 1]]))[:2]
    corners = apply_transform(region, np.array([[0, 0], [111, 0], [0, 111], [111, 111]], dtype=float))
    x0, y0 = np.maximum(np.floor(corners.min(0)).astype(int) - 1, 0)
    x1, y1 = np.floor(corners.max(0)).astype(int) + 2
    assert x1 - x0 < 400 and y1 - y0 < 400  # a small part of the photo
    elsewhere = torch.randint(0, 256, photo.shape, generator=g, dtype=torch.uint8)
    elsewhere[:, y0:y1, x0:x1] = photo[:, y0:y1, x0:x1]
    assert torch.equal(warp_to_template(photo, matrix), warp_to_template(elsewhere, matrix))
    # A crop wholly outside the photo is black.
    assert not warp_to_template(photo, _similarity(0, 1.0, 5000, 0)).any()


def test_a_jpeg_is_decoded_to_pillow_s_pixels_and_the_bytes_read_decode_as_the_file(tmp_path):
    """JPEGs go through libjpeg-turbo straight into a tensor: the pixels Pillow decodes, upright; a broken one is a
    PhotoError; bytes already read decode as the file does (the path then only names it)."""
    from PIL import Image

    from alignment import read_photo_bytes

    pixels = np.random.default_rng(0).integers(0, 256, (300, 400, 3), dtype=np.uint8)
    for mode in ("RGB", "L"):
        Image.fromarray(pixels).convert(mode).save(tmp_path / f"{mode}.jpg", quality=90)
        with Image.open(tmp_path / f"{mode}.jpg") as image:
            expected = np.asarray(image.convert("RGB")).transpose(2, 0, 1)
        np.testing.assert_array_equal(read_photo(tmp_path / f"{mode}.jpg").numpy(), expected)
    data = read_photo_bytes(tmp_path / "RGB.jpg")
    assert torch.equal(read_photo(tmp_path / "elsewhere.jpg", data=data), read_photo(tmp_path / "RGB.jpg"))
    with pytest.raises(PhotoError, match="elsewhere.jpg: an empty file"):
        read_photo(tmp_path / "elsewhere.jpg", data=b"")
    with pytest.raises(PhotoError, match=r"half.jpg: cannot decode: \S"):
        read_photo(tmp_path / "half.jpg", data=data[:len(data) // 2])


def test_small_photos_are_not_enlarged_and_large_ones_fit_the_canvas():
    from alignment import detection_scale

    assert detection_scale(112, 92, 640, 20) == 1.0  # MTCNN finds 20 px faces as they are
    assert detection_scale(112, 92, 640, 10) == 2.0  # a smaller face of interest: enlarged that much
    assert detection_scale(112, 92, 640, 0) == 640 / 112  # every face: onto the canvas (the earlier way)
    assert detection_scale(3000, 4000, 640, 20) == 640 / 4000


def test_a_photo_s_faces_barely_depend_on_its_batch():
    """The detections of a photo are the same, to a hundredth of a pixel, alone or in a batch with photos of
    another size or the same size (the last bits may differ: photos.pipeline detects a photo alone on the CPU)."""
    pytest.importorskip("facenet_pytorch", reason="the face detector is not installed: pip install --no-deps -r "
                                                  "requirements-faces.txt")
    from alignment import FaceDetector

    detector = FaceDetector(min_score=0.0, min_face_size=0.0)
    original = _astronaut()
    photo = _tensor(original)
    other = _tensor(_moved(original, _similarity(10, 0.7, 40, 30), (500, 420)))
    twin = _tensor(_moved(original, _similarity(-5, 0.9, 0, 10), (512, 512)))
    alone, batched = detector.detect([photo])[0], detector.detect([other, photo, twin])[1]
    assert len(alone) == len(batched) == 1
    assert np.abs(np.array(alone[0].box) - batched[0].box).max() < 0.01
    assert np.abs(alone[0].points - batched[0].points).max() < 0.01
