"""eval.overlap and scripts/overlap.py: on generated embeddings of 20,000 classes the threshold, calibrated against
what is compared, finds the shared identities and lets about FAR x images others through (where the image-pair
threshold let nearly all through); on synthetic identities and a tiny network trained on them in-process, identities
put in both sets on purpose are all found, a test set without them reports no more than the FAR allows, ``--drop``
writes the rest (rec and image folder), ``--head`` reads a 2-rank checkpoint, and the blocked similarities equal the
dense ones.

The network is trained on other images of the training set's identities and of the test sets' other identities,
so that it separates them all and has seen none of the images the tool reads. A network trained for seconds on a
few identities does not generalise: it maps identities it never saw near the classes it knows, and the images it
was trained on closer to their own class (and further from the others) than any other image of that identity. The
threshold is calibrated on training images, so a network trained on them lets more through than the FAR says
(measured, the same network trained on the training images themselves: 6 of 30 and 7 of 60 distinct images of
other identities listed, where 0.23 and 0.47 come by chance; docs/overlap.md). The tool's question does not
depend on what the network was trained on: a model trained on other images of a superset of the identities checks
a training set all the same.
"""
from __future__ import annotations

import csv
import io
import json
import math
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from backbones import get_model
from dataset import ImageFolderDataset, MXFaceDataset
from dataset.images import decode, normalise
from dataset.recordio import write_insightface_rec
from dataset.synthetic_faces import (
    EVAL_ID_BASE,
    NuisanceConfig,
    encode_jpeg,
    identity_params,
    image_rng,
    render,
    sample_nuisance,
)
from dataset.verification_set import save_bin
from eval.overlap import (
    CLASS_MAP,
    CSV_COLUMNS,
    ClassMeans,
    Sample,
    calibrate,
    calibration_indices,
    matches,
    nearest_classes,
)
from partial_fc.checkpoint import head_shard
from scripts import overlap
from tests.helpers import ROOT, run_main
from utils.checkpoint import save_checkpoint, step_dir

SEED = 0
NUM_CLASSES = 16  # the training set: identities 0..15
TRAIN_IMAGES = 8  # per identity of the training set
NET_IMAGES = 12  # per identity the network is trained on
NET_FIRST = 100  # its images of an identity are 100..111: none of the training set's 0..7 (see the module's doc)
SHARED = (1, 4, 7, 10, 13)  # training identities put in shared.bin on purpose
OTHERS = list(range(EVAL_ID_BASE["easy"], EVAL_ID_BASE["easy"] + 45))  # in no training set; the network knows them
# The identities of each test set: many, so that its impostor pairs span many pairs of identities, as LFW's do.
SETS = {"shared.bin": [*SHARED, *OTHERS[:15]], "clean.bin": OTHERS[15:]}
SET_IMAGES = 2  # distinct images of each identity of a test set
IMPOSTORS = 360  # different pairs of a test set, drawn among its images: a FAR resolution of 1/360
EMBEDDING = 64
TINY = {"widths": [2, 8, 16, 32]}
MODEL_ARGS = ["--network", "tiny", "--embedding-size", str(EMBEDDING), "--network-kwargs", json.dumps(TINY)]
STEPS = 250


# Milder nuisances than the demo's sets (no occluder, little lighting): a network trained for seconds separates
# the identities well enough that the tests check the tool, not the network.
NUISANCE = NuisanceConfig(rotation_deg=4.0, scale=0.03, shift_px=2.0, yaw=0.02, smile=0.4, mouth_open=0.2,
                          brow_raise=0.02, eye_close=0.2, illumination=0.1, brightness=0.05, contrast=0.05,
                          colour_jitter=0.02, blur_sigma=0.4, noise_sigma=3.0, occlusion_p=0.0, jpeg_quality=(85, 95))


def _jpeg(identity: int, index: int) -> bytes:
    """Image ``index`` of ``identity`` (the same bytes on every call)."""
    nuisance = sample_nuisance(image_rng(SEED, "easy", identity, index), NUISANCE)
    return encode_jpeg(render(identity_params(SEED, identity), nuisance), nuisance.jpeg_quality)


def _write_set(path: Path, identities: list[int], rng: np.random.Generator) -> list[int]:
    """A .bin of SET_IMAGES images of each identity (images no training set holds), paired as every same pair and
    IMPOSTORS different pairs drawn among them (an image in several pairs, as in LFW); the distinct image of every
    image of the file, an index into ``identities`` x SET_IMAGES."""
    jpegs = [_jpeg(identity, 1000 + k) for identity in identities for k in range(SET_IMAGES)]
    pairs = [(i, j) for i in range(len(jpegs)) for j in range(i + 1, len(jpegs))]
    same = [(i, j) for i, j in pairs if i // SET_IMAGES == j // SET_IMAGES]
    different = [(i, j) for i, j in pairs if i // SET_IMAGES != j // SET_IMAGES]
    different = [different[k] for k in rng.choice(len(different), size=IMPOSTORS, replace=False)]
    save_bin(path, [jpegs[k] for pair in same + different for k in pair], [True] * len(same) + [False] * IMPOSTORS)
    return [k for pair in same + different for k in pair]


def _train(images: torch.Tensor, labels: torch.Tensor, classes: int) -> tuple[nn.Module, torch.Tensor]:
    """The tiny network and its class centres after STEPS CosFace steps (s = 32, m = 0.2, AdamW: the demo's
    recipe) on ``images``."""
    torch.manual_seed(SEED)
    net = get_model("tiny", num_features=EMBEDDING, **TINY)
    centres = nn.Parameter(torch.randn(classes, EMBEDDING) * 0.1)  # (C, D)
    opt = torch.optim.AdamW([*net.parameters(), centres], lr=0.002, weight_decay=0.1)
    g = torch.Generator().manual_seed(SEED)
    for _ in range(STEPS):
        pick = torch.randint(0, len(images), (32,), generator=g)
        x = images[pick]  # (32, 3, 112, 112) uint8
        flip = torch.rand(32, generator=g) < 0.5
        x = torch.where(flip.view(-1, 1, 1, 1), x.flip(3), x)
        cos = nn.functional.normalize(net(normalise(x))) @ nn.functional.normalize(centres).T  # (32, C)
        y = labels[pick]
        loss = nn.functional.cross_entropy(32 * (cos - 0.2 * nn.functional.one_hot(y, classes)), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    return net.eval(), centres.detach()


def _save_head(output: Path, centres: torch.Tensor, world_size: int = 2) -> Path:
    """A step checkpoint of ``centres`` written by ``world_size`` ranks (threads), as the trainer writes one."""
    barrier = threading.Barrier(world_size)
    bounds = np.linspace(0, len(centres), world_size + 1).astype(int)
    common = {"step": 1, "world_size": world_size}  # what the store needs of the rank-0 part; overlap reads the head
    errors: list[BaseException] = []

    def rank(r: int) -> None:
        lo, hi = bounds[r], bounds[r + 1]
        shard = head_shard(centres[lo:hi], {"momentum_buffer": torch.zeros(hi - lo, centres.shape[1])}, lo,
                           len(centres))
        try:
            save_checkpoint(output, 1, rank=r, world_size=world_size, head=shard, common=common if r == 0 else None,
                            barrier=lambda: barrier.wait(timeout=30))
        except BaseException as exc:  # noqa: BLE001 - reported by the assertion below
            errors.append(exc)

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(world_size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not errors, errors
    return step_dir(output, 1)


@pytest.fixture(scope="module")
def synth(tmp_path_factory):
    """A rec and the same images as an image folder (16 identities x 8), shared.bin (5 of those identities and
    15 others), clean.bin (30 others), the tiny network trained on other images of all 61 identities, and a 2-rank
    checkpoint of its head's rows of the training set's 16 classes."""
    out = tmp_path_factory.mktemp("overlap")
    jpegs = [(c, _jpeg(c, i)) for c in range(NUM_CLASSES) for i in range(TRAIN_IMAGES)]
    write_insightface_rec(out / "rec", jpegs, NUM_CLASSES)
    for c in range(NUM_CLASSES):
        folder = out / "faces" / f"person_{c:02d}"
        folder.mkdir(parents=True)
        for k in range(TRAIN_IMAGES):
            (folder / f"{k}.jpg").write_bytes(jpegs[c * TRAIN_IMAGES + k][1])
    rng = np.random.default_rng(SEED)
    who = {name[:-len(".bin")]: _write_set(out / name, identities, rng) for name, identities in SETS.items()}
    known = [(c, _jpeg(identity, NET_FIRST + i)) for c, identity in enumerate([*range(NUM_CLASSES), *OTHERS])
             for i in range(NET_IMAGES)]
    images = torch.stack([decode(data, "train") for _, data in known])  # (N, 3, 112, 112)
    net, centres = _train(images, torch.tensor([c for c, _ in known]), NUM_CLASSES + len(OTHERS))
    torch.save(net.state_dict(), out / "model.pt")
    head = _save_head(out / "run", centres[:NUM_CLASSES])
    return {"out": out, "who": who, "head": head}


def _overlap(*argv, process: bool = False) -> subprocess.CompletedProcess:
    """scripts/overlap.py as a user types it: its exit status and streams, from its main in this process
    (``tests.helpers.run_main``), or from a real process."""
    if not process:
        return run_main(overlap.main, list(map(str, argv)), "scripts/overlap.py")
    cmd = [sys.executable, "scripts/overlap.py", *map(str, argv)]
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)


def _rows(text: str) -> list[dict[str, str]]:
    rows = list(csv.DictReader(io.StringIO(text)))
    assert text.splitlines()[0] == ",".join(CSV_COLUMNS)
    return rows


def _chance_bound(identities: int) -> float:
    """How many distinct images of ``identities`` other identities may match a training class by chance. The
    threshold is the largest of the training images' best similarities to another class (FAR 1e-4 is below the
    resolution of NUM_CLASSES x TRAIN_IMAGES images), and the images of one identity are alike, in the training set
    as in a test set: at this size it resolves about one identity in NUM_CLASSES + 1, whose SET_IMAGES images match
    together. A binomial mean plus 3 standard deviations, in identities, times SET_IMAGES."""
    mean = identities / (NUM_CLASSES + 1)
    return SET_IMAGES * (mean + 3 * mean ** 0.5)


def _check_found(rows: list[dict[str, str]], who: dict[str, list[int]]) -> None:
    """Every image of an identity put in both sets is listed with its class; the other identities' distinct
    images no more often than the FAR lets impostors through."""
    listed = {(Path(r["bin"]).name, int(r["image"])): int(r["class"]) for r in rows}
    for name, images in (("shared.bin", who["shared"]), ("clean.bin", who.get("clean", []))):
        chance = set()
        for i, distinct in enumerate(images):
            identity = SETS[name][distinct // SET_IMAGES]
            if identity in SHARED:
                assert listed.get((name, i)) == identity, (name, i, identity, listed.get((name, i)))
            elif (name, i) in listed:
                chance.add(distinct)
        others = sum(identity not in SHARED for identity in SETS[name]) * SET_IMAGES
        assert len(chance) <= _chance_bound(others), (name, sorted(chance))


@pytest.mark.process
@pytest.mark.timeout(300)
def test_shared_identities_are_all_found_and_a_clean_set_stays_within_its_far(synth):
    out, who = synth["out"], synth["who"]
    proc = _overlap(*MODEL_ARGS, "--weights", out / "model.pt", "--rec", out / "rec", "--bin", out / "shared.bin",
                    "--bin", out / "clean.bin", "--device", "cpu", "--workers", "0", process=True)
    print(proc.stderr)  # the closing note quotes it
    assert proc.returncode == 0, proc.stderr
    rows = _rows(proc.stdout)
    _check_found(rows, who)
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 4, lines
    images = NUM_CLASSES * TRAIN_IMAGES
    assert lines[0].startswith("overlap: threshold ") and lines[0].endswith(
        f": the largest of {images} training images' best similarity to a class other than their own (FAR resolution "
        f"1/{images} = {1 / images:.2g}: FAR 0.0001 needs 10000 training images)"), lines[0]
    for line, name in zip(lines[1:3], ("shared.bin", "clean.bin")):
        assert line.startswith(f"overlap: {out / name}: ") and line.endswith("images above the threshold"), line
    assert lines[3].startswith(f"overlap: {len(rows)} of {len(who['shared']) + len(who['clean'])} test images")
    assert "(class means)" in lines[3]


def test_nearest_classes_in_blocks_equal_the_dense_argmax():
    g = torch.Generator().manual_seed(0)
    queries = nn.functional.normalize(torch.randn(37, 8, generator=g, dtype=torch.float64))  # (T, D)
    for sub_centres in (1, 3):
        centres = nn.functional.normalize(torch.randn(23 * sub_centres, 8, generator=g, dtype=torch.float64))
        dense = (queries @ centres.T).view(37, 23, sub_centres).amax(dim=2)  # (T, C)
        want_sim, want_index = dense.max(dim=1)
        # 1: one similarity per block (classes split too); 10: a few classes per block; 100: rows of all classes.
        for block in (1, 10, 5 * 23 * sub_centres, 10 ** 6):
            sim, index = nearest_classes(queries, centres, sub_centres, block_elements=block)
            assert torch.equal(index, want_index), (sub_centres, block)
            torch.testing.assert_close(sim, want_sim, rtol=0, atol=1e-12)
        # Each row without its own class (the calibration's question): the dense argmax of the others.
        own = torch.where(torch.arange(37) % 2 == 0, want_index, torch.randint(0, 23, (37,), generator=g))  # (T,)
        others = dense.clone()
        others[torch.arange(37), own] = -math.inf
        for block in (1, 10, 10 ** 6):
            sim, index = nearest_classes(queries, centres, sub_centres, block_elements=block, exclude=own)
            assert torch.equal(index, others.argmax(dim=1)) and not torch.equal(index, want_index), block
            torch.testing.assert_close(sim, others.amax(dim=1), rtol=0, atol=1e-12)


def _listed_classes(stdout: str) -> set[int]:
    return {int(r["class"]) for r in _rows(stdout)}


@pytest.mark.process
@pytest.mark.timeout(300)
def test_drop_writes_a_rec_without_the_matched_classes(synth, tmp_path):
    out = synth["out"]
    proc = _overlap(*MODEL_ARGS, "--weights", out / "model.pt", "--rec", out / "rec", "--bin", out / "shared.bin",
                    "--drop", tmp_path / "clean_rec", "--workers", "1", "--csv", tmp_path / "overlap.csv")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == ""
    dropped = _listed_classes((tmp_path / "overlap.csv").read_text())
    assert set(SHARED) <= dropped
    source, copy = MXFaceDataset(out / "rec"), MXFaceDataset(tmp_path / "clean_rec")
    kept = [c for c in range(NUM_CLASSES) if c not in dropped]
    assert copy.layout == "insightface" and copy.num_classes == len(kept)
    mapping = list(csv.DictReader(io.StringIO((tmp_path / "clean_rec" / CLASS_MAP).read_text())))
    assert [(int(r["class"]), int(r["original_class"])) for r in mapping] == list(enumerate(kept))
    # The rest is identical: the same image bytes, in the same order, each under its renumbered class.
    want = [(kept.index(label), data) for data, label, _ in map(source.raw, range(len(source))) if label in kept]
    assert [copy.raw(i)[1::-1] for i in range(len(copy))] == want
    assert sorted(p.name for p in tmp_path.iterdir()) == ["clean_rec", "overlap.csv"]  # no staging folder left
    # The summary says what was written.
    assert f"wrote {tmp_path / 'clean_rec'}: {len(kept)} classes, {len(want)} images" in proc.stderr


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_head_centres_of_a_two_rank_checkpoint_and_drop_of_an_image_folder(synth, tmp_path):
    out = synth["out"]
    proc = _overlap(*MODEL_ARGS, "--weights", out / "model.pt", "--rec", out / "faces", "--bin", out / "shared.bin",
                    "--head", synth["head"], "--drop", tmp_path / "clean_faces")
    print(proc.stderr)
    assert proc.returncode == 0, proc.stderr
    rows = _rows(proc.stdout)
    assert all(r["identity"] == f"person_{int(r['class']):02d}" for r in rows)
    _check_found(rows, {"shared": synth["who"]["shared"]})
    assert "(trained centres)" in proc.stderr
    dropped = {int(r["class"]) for r in rows}
    source, copy = ImageFolderDataset(out / "faces"), ImageFolderDataset(tmp_path / "clean_faces")
    assert copy.classes == [name for c, name in enumerate(source.classes) if c not in dropped]
    for name in copy.classes:
        files = sorted((out / "faces" / name).iterdir())
        assert [p.name for p in files] == sorted(p.name for p in (tmp_path / "clean_faces" / name).iterdir())
        assert all((tmp_path / "clean_faces" / name / p.name).read_bytes() == p.read_bytes() for p in files)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["clean_faces"]


def _one_error_line(proc: subprocess.CompletedProcess, code: int, *words: str) -> str:
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == code, proc.stderr
    assert len(lines) == 1 and lines[0].startswith("overlap: error: "), lines
    assert all(w in lines[0] for w in words), (lines[0], words)
    return lines[0]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_errors_are_one_line_with_the_documented_exit_status(synth, tmp_path, capsys):
    out = synth["out"]
    model = [*MODEL_ARGS, "--weights", out / "model.pt", "--workers", "0"]
    save_bin(tmp_path / "small.bin", [_jpeg(0, 0), _jpeg(0, 1), _jpeg(1, 0), _jpeg(2, 0)], [True, False])
    # 2: usage and configuration.
    _one_error_line(_overlap(*model, "--rec", out / "rec", "--bin", tmp_path / "lfw.bin"), 2, "not found", "lfw.bin")
    _one_error_line(_overlap(*model, "--rec", tmp_path / "nowhere", "--bin", out / "shared.bin"), 2, "nowhere")
    head = _overlap(*model, "--rec", out / "rec", "--bin", tmp_path / "small.bin", "--head", tmp_path)
    _one_error_line(head, 2, "neither a step checkpoint folder")
    (tmp_path / "few").mkdir()
    for c in range(3):
        (tmp_path / "few" / f"id{c}").mkdir()
        (tmp_path / "few" / f"id{c}" / "0.jpg").write_bytes(_jpeg(c, 0))
    other = _overlap(*model, "--rec", tmp_path / "few", "--bin", tmp_path / "small.bin", "--head", synth["head"])
    _one_error_line(other, 2, f"the head has {NUM_CLASSES} classes", "few has 3")
    # Options argparse refuses: its usage line and one error line, exit 2 (before anything is read).
    (tmp_path / "exists").mkdir()
    common = [*map(str, model), "--rec", str(out / "rec"), "--bin", str(tmp_path / "small.bin")]
    for extra, message in ((["--drop", str(tmp_path / "exists")], "exists; --drop writes a new folder"),
                           (["--drop", str(out / "rec" / "clean")], "is inside the training set"),
                           (["--far", "0"], "--far must be in (0, 1), got 0.0"),
                           (["--bin", str(tmp_path / "small.bin")], "is given twice")):
        with pytest.raises(SystemExit) as exit_:
            overlap.parse_args([*common, *extra])
        assert exit_.value.code == 2 and message in capsys.readouterr().err.strip().splitlines()[-1], extra
    # 1: bad data, naming the file.
    (tmp_path / "cut.bin").write_bytes((out / "shared.bin").read_bytes()[:1000])
    _one_error_line(_overlap(*model, "--rec", out / "rec", "--bin", tmp_path / "cut.bin"), 1, "cut.bin", "truncated")
    (tmp_path / "one" / "id0").mkdir(parents=True)  # one class: no other class to calibrate the threshold against
    (tmp_path / "one" / "id0" / "0.jpg").write_bytes(_jpeg(0, 0))
    one = _overlap(*model, "--rec", tmp_path / "one", "--bin", tmp_path / "small.bin")
    _one_error_line(one, 1, str(tmp_path / "one"), "1 class with images")
    shutil.copytree(out / "rec", tmp_path / "damaged")
    rec = tmp_path / "damaged" / "train.rec"
    rec.write_bytes(rec.read_bytes()[:rec.stat().st_size // 2])
    damaged = _overlap(*model, "--rec", tmp_path / "damaged", "--bin", tmp_path / "small.bin")
    _one_error_line(damaged, 1, str(rec), "past the end")
    (tmp_path / "bad_faces" / "a").mkdir(parents=True)
    (tmp_path / "bad_faces" / "a" / "0.jpg").write_bytes(b"\xff\xd8 not a jpeg")
    bad = _overlap(*model, "--rec", tmp_path / "bad_faces", "--bin", tmp_path / "small.bin")
    _one_error_line(bad, 1, "0.jpg", "cannot decode")


def test_the_threshold_is_the_sample_s_best_other_class_similarity_a_fraction_far_lies_above():
    g = torch.Generator().manual_seed(0)
    for sub_centres in (1, 2):
        centres = nn.functional.normalize(torch.randn(7 * sub_centres, 4, generator=g))  # (C·K, D), 7 classes
        classes = ClassMeans(centres, torch.tensor([0, 2, 3, 5, 8, 9, 11]), sub_centres, None)  # ids with images
        embeddings = nn.functional.normalize(torch.randn(400, 4, generator=g))  # (S, D)
        labels = classes.ids[torch.randint(0, 7, (400,), generator=g)]  # (S,) each image's own class id
        dense = (embeddings @ centres.T).view(400, 7, sub_centres).amax(dim=2)  # (S, C)
        dense[torch.arange(400), torch.searchsorted(classes.ids, labels)] = -math.inf  # not its own class
        best = dense.amax(dim=1).sort(descending=True).values  # (S,)
        # FAR 0.01 of 400 images: 4 above, the 5th largest; blocks of 3 similarities split rows and classes.
        found = calibrate(Sample(embeddings, labels), classes, 0.01, Path("train"), block_elements=3)
        assert (found.value, found.images, found.above) == (float(best[4]), 400, 4)
        assert found.describe(0.01) == (f"threshold {best[4]:.4f}: 400 training images' best similarity to a class "
                                        f"other than their own, at FAR 0.01 per image (4 above)")
        few = calibrate(Sample(embeddings[:40], labels[:40]), classes, 0.01, Path("train"))  # 40 < 1 / FAR
        assert few.value == float(dense[:40].amax(dim=1).max()) and few.above == 0 and few.rate == 1 / 40
        assert "the largest of 40 training images' best similarity to a class other than their own (FAR " \
               "resolution 1/40 = 0.025: FAR 0.01 needs 100 training images)" in few.describe(0.01)
    one = ClassMeans(centres[:1], torch.tensor([3]), 1, None)
    with pytest.raises(ValueError, match="train: 1 class with images; the threshold is calibrated on training"):
        calibrate(Sample(embeddings[:2], torch.tensor([3, 3])), one, 0.01, Path("train"))
    assert len(calibration_indices(100, 0.5)) == 20 and len(calibration_indices(10, 1e-4)) == 10
    assert np.array_equal(calibration_indices(10**6, 1e-4), calibration_indices(10**6, 1e-4))  # a fixed draw


def test_at_20000_classes_shared_identities_are_found_and_others_match_at_far_per_image():
    """Issue 45: generated embeddings (an identity is a direction plus a component every face shares; an image adds
    noise), 20,000 training classes (the mean of 10 images each), 100 of them also in the test set (2 images each)
    with 1,800 images of identities in no class. The image-pair threshold the tool used before lets nearly every
    test image through; the calibrated one finds the shared identities and lets about FAR x images others through."""
    dim, classes_n, far, per_class, spread = 128, 20_000, 1e-3, 10, 0.8
    shared_n, unseen_n = 100, 1800
    g = torch.Generator().manual_seed(0)
    common = nn.functional.normalize(torch.randn(dim, generator=g), dim=0)
    directions = nn.functional.normalize(torch.randn(classes_n + unseen_n, dim, generator=g))

    def faces(who: torch.Tensor, noise: float) -> torch.Tensor:  # (N, D) unit embeddings of identities ``who``
        jitter = noise * torch.randn(len(who), dim, generator=g) / math.sqrt(dim)
        return nn.functional.normalize(0.5 * common + directions[who] + jitter)

    classes = ClassMeans(faces(torch.arange(classes_n), spread / math.sqrt(per_class)), torch.arange(classes_n), 1,
                         None)  # a class mean: its images' noise averaged
    picked = torch.from_numpy(calibration_indices(classes_n * per_class, far))  # image i is of class i // 10
    threshold = calibrate(Sample(faces(picked // per_class, spread), picked // per_class), classes, far,
                          Path("train"))
    shared = torch.arange(shared_n).repeat_interleave(2) * 199  # 100 training identities, 2 images each
    who = torch.cat([shared, classes_n + torch.arange(unseen_n)])  # (2,000,)
    test = faces(who, spread)
    listed = {m.image: m.class_id for m in matches(Path("test.bin"), test, classes, threshold)}
    found = {int(who[i]) for i, c in listed.items() if c == int(who[i])}
    false = [i for i, c in listed.items() if c != int(who[i])]
    assert len(found) >= 0.95 * shared_n, (len(found), threshold)
    assert len(false) <= far * len(who) + 3, (len(false), threshold)
    # The image-pair calibration: impostor pairs among the test images at the same FAR.
    a, b = torch.randint(0, len(who), (2, 6000), generator=g)
    impostors = (test[a] * test[b]).sum(dim=1)[who[a] != who[b]]
    image_pair = float(impostors.sort(descending=True).values[math.floor(far * impostors.numel())])
    best, _ = nearest_classes(test[2 * shared_n:], classes.centres)  # the unseen identities' images
    assert int((best > image_pair).sum()) > 0.5 * unseen_n and int((best > threshold.value).sum()) <= far * 2000 + 3
