"""Data sets for the training job. Nothing is ever downloaded.

Every loader returns a :class:`Dataset` with train/test splits as numpy arrays; ranks
take strided shards of the training split. Errors are ``DataError`` with a message that
names the file and the problem.
"""

import gzip
import importlib.util
import os
import pickle

import numpy as np

NAMES = ("digits", "fashion-mnist", "synthetic", "cifar10")

#: Where Debian's package ``dataset-fashion-mnist`` puts the original idx.gz files.
FASHION_MNIST_DIR = "/usr/share/datasets/fashion-mnist"


class DataError(ValueError):
    """Bad or missing data."""


class Dataset:
    def __init__(self, name, x_train, y_train, x_test, y_test, shape, classes):
        self.name, self.shape, self.classes = name, tuple(shape), int(classes)
        self.x_train, self.y_train = x_train, y_train
        self.x_test, self.y_test = x_test, y_test
        for split, x, y in (("train", x_train, y_train), ("test", x_test, y_test)):
            if x.ndim < 2 or len(x) != len(y):
                raise DataError(f"{name}: {split} split has {len(x)} inputs of shape {x.shape[1:]} "
                                f"but {len(y)} labels")
            if tuple(x.shape[1:]) != self.shape:
                raise DataError(f"{name}: {split} inputs have shape {x.shape[1:]}, expected {self.shape}")
            if len(x) == 0:
                raise DataError(f"{name}: {split} split is empty")
            if not (np.isfinite(x.min()) and np.isfinite(x.max())):   # NaN propagates; no temporary array
                raise DataError(f"{name}: {split} inputs contain NaN or infinity")
            if y.min() < 0 or y.max() >= self.classes:
                raise DataError(f"{name}: {split} labels must be integers in [0, {self.classes})")

    def shard(self, rank, size):
        """This rank's strided share of the training split."""
        if len(self.x_train) < size:
            raise DataError(f"{self.name}: {len(self.x_train)} training samples cannot feed {size} ranks")
        return self.x_train[rank::size], self.y_train[rank::size]

    def __repr__(self):
        return (f"<Dataset {self.name} train={len(self.x_train)} test={len(self.x_test)} "
                f"shape={self.shape} classes={self.classes}>")


def _split(x, y, seed, test_fraction=0.2):
    order = np.random.default_rng(seed).permutation(len(x))
    cut = int(round(len(x) * (1 - test_fraction)))
    return x[order[:cut]], y[order[:cut]], x[order[cut:]], y[order[cut:]]


def digits(seed=0):
    """scikit-learn's bundled handwritten digits (1797 8x8 images, 10 classes), scaled to [0, 1]."""
    table = _digits_table()
    x = (table[:, :-1] / 16.0).astype(np.float32).reshape(-1, 1, 8, 8)
    y = table[:, -1].astype(np.int64)
    return Dataset("digits", *_split(x, y, seed), shape=(1, 8, 8), classes=10)


def _digits_table():
    """The digits as scikit-learn ships them (``sklearn/datasets/data/digits.csv.gz``: 64 pixels
    and the label a row), read directly: importing ``sklearn.datasets`` costs about a second a
    process (SciPy), as much as a short training run; ``load_digits`` where the file is not found."""
    spec = importlib.util.find_spec("sklearn")   # finds the package without importing it
    if spec is None:
        raise DataError("the digits data set needs scikit-learn: pip install 'mpigossip[data]'")
    for folder in spec.submodule_search_locations or ():
        path = os.path.join(folder, "datasets", "data", "digits.csv.gz")
        if os.path.isfile(path):
            return np.loadtxt(path, delimiter=",")
    from sklearn.datasets import load_digits
    bunch = load_digits()
    return np.column_stack([bunch.data, bunch.target])


def synthetic(samples=20000, features=64, classes=10, seed=0, *, clusters=1, label_noise=0.0):
    """A deterministic classification problem of any size: Gaussian clusters in ``features``
    dimensions, ``clusters`` per class (with more than one, the classes are not linearly
    separable: a harder problem that needs the MLP), and a ``label_noise`` fraction of the
    training labels replaced by random ones (the test labels stay clean)."""
    if samples < 2 or features < 1 or classes < 2 or clusters < 1:
        raise DataError(f"synthetic: need samples >= 2, features >= 1, classes >= 2, clusters >= 1 "
                        f"(got {samples}, {features}, {classes}, {clusters})")
    if not 0 <= label_noise < 1:
        raise DataError(f"synthetic: label noise must be in [0, 1), got {label_noise}")
    rng = np.random.default_rng(seed + 12345)
    centers = rng.standard_normal((classes * clusters, features)).astype(np.float32) * 1.5
    which = rng.integers(0, classes * clusters, samples)
    y = which % classes
    x = centers[which] + rng.standard_normal((samples, features)).astype(np.float32)
    data = Dataset("synthetic", *_split(x.astype(np.float32), y.astype(np.int64), seed),
                   shape=(features,), classes=classes)
    if label_noise:
        flip = rng.random(len(data.y_train)) < label_noise
        data.y_train = np.where(flip, rng.integers(0, classes, len(data.y_train)), data.y_train).astype(np.int64)
    return data


def _idx(path):
    """One idx file (gzip or not) as a numpy array: the format of (Fashion-)MNIST."""
    opener = gzip.open if path.endswith(".gz") else open
    try:
        with opener(path, "rb") as f:
            raw = f.read()
        if len(raw) < 4 or raw[0] != 0 or raw[1] != 0 or raw[2] != 0x08:
            raise ValueError("not an idx file of unsigned bytes")
        ndim = raw[3]
        dims = np.frombuffer(raw, dtype=">u4", count=ndim, offset=4).astype(np.int64)
        data = np.frombuffer(raw, dtype=np.uint8, offset=4 + 4 * ndim)
        if data.size != int(np.prod(dims)):
            raise ValueError(f"holds {data.size} bytes for dimensions {tuple(dims)}")
        return data.reshape(tuple(dims))
    except (OSError, ValueError, EOFError) as exc:
        raise DataError(f"fashion-mnist: {path} is not a readable idx file ({exc})") from None


def fashion_mnist_files(directory=None):
    """``{"x_train": path, ...}``: Fashion-MNIST's four idx files in ``directory`` (default
    :data:`FASHION_MNIST_DIR`), gzipped or not; a ``DataError`` naming the Debian package
    when one is missing."""
    directory = directory or FASHION_MNIST_DIR
    names = {"x_train": "train-images-idx3-ubyte", "y_train": "train-labels-idx1-ubyte",
             "x_test": "t10k-images-idx3-ubyte", "y_test": "t10k-labels-idx1-ubyte"}
    paths = {}
    for key, name in names.items():
        path = next((os.path.join(directory, name + ext) for ext in (".gz", "")
                     if os.path.isfile(os.path.join(directory, name + ext))), None)
        if path is None:
            raise DataError(f"fashion-mnist: {os.path.join(directory, name)}.gz not found: install Debian's package "
                            "dataset-fashion-mnist (apt-get install dataset-fashion-mnist) or pass --data-dir")
        paths[key] = path
    return paths


def fashion_mnist(directory=None, samples=None):
    """Fashion-MNIST (Xiao et al. 2017: 60000 training and 10000 test 28x28 grey images of
    clothes, 10 classes) from its original idx files, ``train-images-idx3-ubyte.gz`` etc., in
    ``directory`` (default :data:`FASHION_MNIST_DIR`, where Debian's ``dataset-fashion-mnist``
    installs them). Standardised with the training split's mean and deviation. ``samples``:
    only the first N training images (a slice for tests); the test split stays whole. The
    split is the data set's own, so it is the same for every seed."""
    arrays = {key: _idx(path) for key, path in fashion_mnist_files(directory).items()}
    if samples is not None:
        if samples < 1:
            raise DataError(f"fashion-mnist: --samples must be >= 1, got {samples}")
        arrays["x_train"], arrays["y_train"] = arrays["x_train"][:samples], arrays["y_train"][:samples]
    return Dataset("fashion-mnist", _standardised(arrays["x_train"]), arrays["y_train"].astype(np.int64),
                   _standardised(arrays["x_test"]), arrays["y_test"].astype(np.int64), shape=(1, 28, 28), classes=10)


def _standardised(images, mean=0.2860, std=0.3530, rows=4096):
    """``(images / 255 - mean) / std`` as float32 images of one channel (``mean`` and ``std``:
    the whole training split's, in [0, 1] units), computed in float64 a few thousand images at a
    time and rounded once (a 256-entry lookup table gives the same values at 4x the time: numpy
    widens the uint8 indices first)."""
    out = np.empty(images.shape, np.float32)
    for lo in range(0, len(images), rows):
        block = images[lo:lo + rows].astype(np.float64)
        block /= 255.0
        block -= mean
        block /= std
        out[lo:lo + rows] = block
    return out.reshape(-1, 1, 28, 28)


def cifar10(directory):
    """CIFAR-10 from a local directory in its standard python format
    (``data_batch_1`` .. ``data_batch_5``, ``test_batch``; or the ``cifar-10-batches-py`` folder)."""
    if directory is None:
        raise DataError("cifar10: pass --data-dir, the folder holding data_batch_1..5 and test_batch")
    if os.path.isdir(os.path.join(directory, "cifar-10-batches-py")):
        directory = os.path.join(directory, "cifar-10-batches-py")

    def load(name):
        path = os.path.join(directory, name)
        if not os.path.isfile(path):
            raise DataError(f"cifar10: {path} not found (the data set is never downloaded)")
        try:
            with open(path, "rb") as f:
                batch = pickle.load(f, encoding="bytes")
            x = np.asarray(batch[b"data"], dtype=np.uint8).reshape(-1, 3, 32, 32)
            return x, np.asarray(batch[b"labels"], dtype=np.int64)
        except Exception as exc:
            raise DataError(f"cifar10: {path} is not a CIFAR-10 python batch ({exc})") from None

    parts = [load(f"data_batch_{i}") for i in range(1, 6)]
    xt, yt = load("test_batch")
    mean = np.array([0.4914, 0.4822, 0.4465], np.float32).reshape(1, 3, 1, 1)
    std = np.array([0.2470, 0.2435, 0.2616], np.float32).reshape(1, 3, 1, 1)
    norm = lambda x: ((x.astype(np.float32) / 255.0) - mean) / std  # noqa: E731
    return Dataset("cifar10", norm(np.concatenate([p[0] for p in parts])), np.concatenate([p[1] for p in parts]),
                   norm(xt), yt, shape=(3, 32, 32), classes=10)


def npz(path, seed=0):
    """User data: a ``.npz`` with ``x_train, y_train, x_test, y_test`` (or ``x, y``, split 80/20).
    Inputs are float arrays of shape (N, ...); labels integers in [0, classes)."""
    if not os.path.isfile(path):
        raise DataError(f"{path}: no such file")
    try:
        with np.load(path, allow_pickle=False) as f:
            arrays = {k: f[k] for k in f.files}
    except Exception as exc:
        raise DataError(f"{path}: not a readable .npz file ({exc})") from None
    if {"x_train", "y_train", "x_test", "y_test"} <= arrays.keys():
        parts = [arrays[k] for k in ("x_train", "y_train", "x_test", "y_test")]
    elif {"x", "y"} <= arrays.keys():
        if len(arrays["x"]) != len(arrays["y"]):
            raise DataError(f"{path}: x has {len(arrays['x'])} samples but y has {len(arrays['y'])}")
        parts = list(_split(arrays["x"], arrays["y"], seed))
    else:
        raise DataError(f"{path}: expected arrays x_train, y_train, x_test, y_test (or x, y); found "
                        + ", ".join(sorted(arrays)))
    x_train, y_train, x_test, y_test = parts
    if x_train.ndim < 2:
        raise DataError(f"{path}: inputs must have shape (N, ...), got {x_train.shape}")
    for name, y in (("y_train", y_train), ("y_test", y_test)):
        if y.ndim != 1 or not np.issubdtype(y.dtype, np.integer):
            raise DataError(f"{path}: {name} must be a 1-D integer array, got {y.dtype} {y.shape}")
    classes = int(max(y_train.max(), y_test.max())) + 1
    return Dataset(os.path.basename(path), x_train.astype(np.float32), y_train.astype(np.int64),
                   x_test.astype(np.float32), y_test.astype(np.int64), shape=x_train.shape[1:], classes=classes)


def load(name, *, data_dir=None, seed=0, samples=None, features=64, classes=10, clusters=1, label_noise=0.0):
    """Load by ``--dataset`` value: a name in :data:`NAMES` or a path to a ``.npz`` file.
    ``seed`` is the data seed (``--data-seed``): the synthetic problem and the held-out
    split of digits and of an ``x, y`` file; the training seed does not change the data."""
    if name == "digits":
        return digits(seed)
    if name == "fashion-mnist":
        return fashion_mnist(data_dir, samples)
    if name == "synthetic":
        return synthetic(20000 if samples is None else samples, features, classes, seed, clusters=clusters,
                         label_noise=label_noise)
    if name == "cifar10":
        return cifar10(data_dir)
    if name.endswith(".npz"):
        return npz(name, seed)
    raise DataError(f"unknown data set {name!r}: use {', '.join(NAMES)} or a path to a .npz file")
