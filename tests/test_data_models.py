"""Data loaders and models of the training job (serial; no MPI)."""

import os
import pickle

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from mpigossip.train import data, models  # noqa: E402


def fake_cifar(folder, per_batch=6):
    rng = np.random.default_rng(0)
    for name in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]:
        batch = {b"data": rng.integers(0, 256, (per_batch, 3072), dtype=np.uint8),
                 b"labels": list(rng.integers(0, 10, per_batch))}
        with open(os.path.join(folder, name), "wb") as f:
            pickle.dump(batch, f)


def test_cifar10_from_a_local_folder(tmp_path):
    fake_cifar(tmp_path)
    ds = data.load("cifar10", data_dir=str(tmp_path))
    assert ds.shape == (3, 32, 32) and len(ds.x_train) == 30 and len(ds.x_test) == 6
    assert ds.x_train.dtype == np.float32 and abs(float(ds.x_train.mean())) < 2
    with pytest.raises(data.DataError, match="never downloaded"):
        data.load("cifar10", data_dir=str(tmp_path / "missing"))
    with pytest.raises(data.DataError, match="--data-dir"):
        data.load("cifar10")


FMNIST = data.FASHION_MNIST_DIR
needs_fmnist = pytest.mark.skipif(not os.path.exists(os.path.join(FMNIST, "train-images-idx3-ubyte.gz")),
                                  reason="Fashion-MNIST not installed: apt-get install dataset-fashion-mnist "
                                  "(tests/run.sh does, as root)")


@needs_fmnist
def test_fashion_mnist_from_the_debian_package():
    d = data.load("fashion-mnist", samples=500)
    assert d.x_train.shape == (500, 1, 28, 28) and d.x_test.shape == (10000, 1, 28, 28)
    assert d.x_train.dtype == np.float32 and d.classes == 10 and set(np.unique(d.y_test)) == set(range(10))
    assert abs(float(d.x_test.mean())) < 0.1 and abs(float(d.x_test.std()) - 1) < 0.1  # standardised
    again = data.load("fashion-mnist", samples=500, seed=7)  # the data seed changes nothing: the split is given
    assert np.array_equal(d.x_train, again.x_train) and np.array_equal(d.y_test, again.y_test)


def _idx(path, array):
    import gzip
    head = bytes([0, 0, 8, array.ndim]) + b"".join(int(n).to_bytes(4, "big") for n in array.shape)
    with gzip.open(path, "wb") as f:
        f.write(head + array.astype(np.uint8).tobytes())


def test_fashion_mnist_idx_files_and_errors(tmp_path):
    rng = np.random.default_rng(0)
    with pytest.raises(data.DataError, match="apt-get install dataset-fashion-mnist"):
        data.load("fashion-mnist", data_dir=str(tmp_path))
    _idx(tmp_path / "train-images-idx3-ubyte.gz", rng.integers(0, 256, (20, 28, 28)))
    _idx(tmp_path / "train-labels-idx1-ubyte.gz", rng.integers(0, 10, 20))
    _idx(tmp_path / "t10k-images-idx3-ubyte.gz", rng.integers(0, 256, (5, 28, 28)))
    _idx(tmp_path / "t10k-labels-idx1-ubyte.gz", np.arange(5))
    d = data.load("fashion-mnist", data_dir=str(tmp_path))
    assert d.x_train.shape == (20, 1, 28, 28) and list(d.y_test) == [0, 1, 2, 3, 4]
    (tmp_path / "t10k-labels-idx1-ubyte.gz").write_bytes(b"not gzip")
    with pytest.raises(data.DataError, match="not a readable idx file"):
        data.load("fashion-mnist", data_dir=str(tmp_path))


def test_fashion_mnist_standardisation_is_the_exact_per_pixel_formula():
    """Computed block by block in float64 and rounded once: every pixel value maps to
    ``float32((v / 255 - mean) / std)`` exactly, across block boundaries."""
    x = np.random.default_rng(1).integers(0, 256, (9000, 28, 28), dtype=np.uint8)
    x[0, 0, :] = np.arange(28) * 9   # 0 and 243 among them
    x[-1, -1, -1] = 255
    table = ((np.arange(256) / 255.0 - 0.2860) / 0.3530).astype(np.float32)
    assert np.array_equal(data._standardised(x), table[x].reshape(-1, 1, 28, 28))


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_a_non_finite_input_is_refused(bad):
    x = np.zeros((4, 3), np.float32)
    x[2, 1] = bad
    y = np.zeros(4, np.int64)
    with pytest.raises(data.DataError, match="NaN or infinity"):
        data.Dataset("t", x, y, np.zeros((2, 3), np.float32), y[:2], shape=(3,), classes=2)
    data.Dataset("t", np.zeros((4, 3), np.float32), y, np.zeros((2, 3), np.float32), y[:2], shape=(3,), classes=2)


def test_digits_read_directly_equal_scikit_learns_loader():
    """The digits are read from scikit-learn's file without importing sklearn.datasets (a
    second a process): the same pixels and labels as its loader."""
    from sklearn.datasets import load_digits
    bunch, table = load_digits(), data._digits_table()
    assert np.array_equal(table[:, :-1], bunch.data) and np.array_equal(table[:, -1], bunch.target)


def test_digits_and_synthetic_are_deterministic_and_shardable():
    a, b = data.load("digits", seed=1), data.load("digits", seed=1)
    assert np.array_equal(a.x_train, b.x_train) and a.shape == (1, 8, 8) and a.classes == 10
    assert len(a.x_train) + len(a.x_test) == 1797
    x0, _ = a.shard(0, 4)
    x3, _ = a.shard(3, 4)
    assert abs(len(x0) - len(x3)) <= 1
    s = data.load("synthetic", samples=500, features=7, classes=3, seed=2)
    assert s.shape == (7,) and s.classes == 3 and len(s.x_train) == 400
    assert np.array_equal(s.x_test, data.load("synthetic", samples=500, features=7, classes=3, seed=2).x_test)
    with pytest.raises(data.DataError, match="cannot feed"):
        s.shard(0, 1000)
    with pytest.raises(data.DataError, match="unknown data set"):
        data.load("imagenet")


def test_npz_errors(tmp_path):
    path = tmp_path / "nan.npz"
    np.savez(path, x=np.full((10, 2), np.nan), y=np.zeros(10, dtype=np.int64))
    with pytest.raises(data.DataError, match="NaN"):
        data.load(str(path))
    path = tmp_path / "keys.npz"
    np.savez(path, inputs=np.zeros((10, 2)))
    with pytest.raises(data.DataError, match="expected arrays"):
        data.load(str(path))
    path = tmp_path / "labels.npz"
    np.savez(path, x=np.zeros((10, 2)), y=np.zeros(10))
    with pytest.raises(data.DataError, match="integer array"):
        data.load(str(path))


@pytest.mark.parametrize("name, shape", [("logreg", (64,)), ("mlp", (1, 8, 8)), ("cnn", (1, 8, 8)),
                                         ("cnn", (3, 32, 32)), ("resnet18", (3, 32, 32))])
def test_models_forward_and_backward(name, shape):
    torch.manual_seed(0)
    model = models.build(name, shape, 10)
    x = torch.randn(2, *shape)
    out = model(x)
    assert out.shape == (2, 10)
    out.sum().backward()
    assert all(p.grad is not None for p in model.parameters())


def test_image_models_reject_flat_inputs():
    with pytest.raises(ValueError, match="image inputs"):
        models.build("cnn", (64,), 10)
    with pytest.raises(ValueError, match="unknown model"):
        models.build("vit", (3, 32, 32), 10)


def test_synthetic_clusters_and_label_noise():
    """Clusters per class keep the labels balanced and the data deterministic; label noise
    changes about that fraction of the training labels (a random label may equal the true
    one: 9/10 of them differ with 10 classes) and never the test labels."""
    clean = data.load("synthetic", samples=20000, features=12, classes=10, seed=3, clusters=8)
    noisy = data.load("synthetic", samples=20000, features=12, classes=10, seed=3, clusters=8, label_noise=0.2)
    assert np.array_equal(clean.x_train, noisy.x_train) and np.array_equal(clean.y_test, noisy.y_test)
    changed = np.mean(clean.y_train != noisy.y_train)
    assert 0.16 < changed < 0.20
    assert np.bincount(clean.y_train, minlength=10).min() > 0.08 * len(clean.y_train)
    one = data.load("synthetic", samples=500, features=7, classes=3, seed=2, clusters=1)
    assert np.array_equal(one.x_train, data.load("synthetic", samples=500, features=7, classes=3, seed=2).x_train)
    with pytest.raises(data.DataError, match="label noise"):
        data.load("synthetic", label_noise=1.0)
    with pytest.raises(data.DataError, match="clusters"):
        data.load("synthetic", clusters=0)


def test_width_sets_the_hidden_layer():
    mlp = models.build("mlp", (12,), 10, width=1024)
    assert sum(p.numel() for p in mlp.parameters()) == 12 * 1024 + 1024 + 1024 * 1024 + 1024 + 1024 * 10 + 10
    assert sum(p.numel() for p in models.build("mlp", (12,), 10).parameters()) == 12 * 128 + 128 + 128 * 128 + 128 + 1290
