"""``public_selection``: which pool rows are public (random, the first ones, a count per class), and its refusals."""

import pytest
import torch

from datamodules import CIFAR10DataModule, DataSplits, PublicPrivateDataModule, TensorPairDataset
from datamodules.selection import largest_remainder_counts
from dm_helpers import IndexedDataModule
from lit_zodp.errors import ConfigError, PrivacyConfigError
from test_dm_vision import fake_cifar10


class LabelledDataModule(PublicPrivateDataModule):
    """A pool whose inputs are their indices and whose labels are given (``labels``), 10 classes by default."""

    def __init__(self, labels=None, num_classes=10, labels_readable=True, **kwargs):
        self.labels, self.classes, self.labels_readable = labels, num_classes, labels_readable
        super().__init__(**kwargs)

    def load_splits(self):
        labels = torch.as_tensor(self.labels)
        pool = TensorPairDataset(torch.arange(len(labels)).float()[:, None], labels)
        if not self.labels_readable:
            pool = torch.utils.data.Subset(pool, range(len(labels)))  # no .targets, no train_labels
        test = TensorPairDataset(torch.zeros(4, 1), torch.zeros(4, dtype=torch.long))
        return DataSplits(train=pool, test=test, num_classes=self.classes)


def built(cls=LabelledDataModule, **kwargs):
    dm = cls(**{"batch_size": 4, **kwargs})
    dm.setup("fit")
    return dm


def old_random_carve(pool_size, seed, public_fraction, val_fraction, max_public=None, max_private=None):
    """The carve before ``public_selection`` existed (no groups), copied as it was."""
    order = torch.randperm(pool_size, generator=torch.Generator().manual_seed(seed)).tolist()
    n_public = round(public_fraction * pool_size)
    if max_public is not None:
        n_public = min(n_public, max_public)
    n_val = round(val_fraction * pool_size)
    private = order[n_public + n_val:]
    if max_private is not None:
        private = private[:max_private]
    return sorted(order[:n_public]), sorted(order[n_public:n_public + n_val]), sorted(private)


@pytest.mark.parametrize("seed, public_fraction, val_fraction, max_public, max_private",
                         [(0, 0.04, 0.0, None, None), (3, 0.2, 0.1, None, None), (7, 0.3, 0.2, 25, 100),
                          (11, 0.0, 0.15, None, 50)])
def test_random_selection_is_the_carve_it_always_was(seed, public_fraction, val_fraction, max_public, max_private):
    dm = built(IndexedDataModule, n=500, data_seed=seed, public_fraction=public_fraction, val_fraction=val_fraction,
               max_public_samples=max_public, max_private_samples=max_private)
    expected = old_random_carve(500, seed, public_fraction, val_fraction, max_public, max_private)
    assert (dm.public_indices, dm.val_indices, dm.private_indices) == expected


def test_first_takes_the_pools_first_rows_and_validation_at_random_from_the_rest():
    labels = [i % 10 for i in range(1000)]
    dm = built(labels=labels, public_selection="first", public_fraction=0.04, val_fraction=0.1, data_seed=2)
    assert dm.public_indices == list(range(40))
    order = torch.randperm(1000, generator=torch.Generator().manual_seed(2)).tolist()
    rest = [i for i in order if i >= 40]
    assert dm.val_indices == sorted(rest[:100]) and dm.private_indices == sorted(rest[100:])
    capped = built(labels=labels, public_selection="first", public_fraction=0.04, max_public_samples=25)
    assert capped.public_indices == list(range(25)) and capped.n_private == 975


def test_largest_remainder_counts_of_table_7s_big_imbalance():
    """[1.0:0.9:...:0.1] of 2,000 (PAZO Table 7): quotas 363.64, 327.27, 290.91, 254.55, 218.18, 181.82, 145.45,
    109.09, 72.73, 36.36; the floors sum to 1,995 and the five largest remainders (.909, .818, .727, .636, .545:
    classes 2, 5, 8, 0, 3) get one more."""
    weights = [round(1.0 - 0.1 * c, 1) for c in range(10)]
    assert largest_remainder_counts(2000, weights) == [364, 327, 291, 255, 218, 182, 145, 109, 73, 36]
    assert largest_remainder_counts(4000, [1] * 200) == [20] * 200  # Tiny-ImageNet: 20 per class
    assert largest_remainder_counts(7, [1, 1, 1]) == [3, 2, 2]  # tie: the lower class first
    assert largest_remainder_counts(0, [1, 2]) == [0, 0]


def test_per_class_counts_are_the_weights_split_drawn_in_permutation_order_and_disjoint():
    labels = [(i * 7) % 10 for i in range(6000)]  # 600 per class, interleaved
    weights = [round(1.0 - 0.1 * c, 1) for c in range(10)]
    dm = built(labels=labels, public_selection="per_class", public_class_weights=weights, public_fraction=1 / 3,
               val_fraction=0.1, data_seed=4)
    counts = [sum(labels[i] == c for i in dm.public_indices) for c in range(10)]
    assert counts == [364, 327, 291, 255, 218, 182, 145, 109, 73, 36]
    order = torch.randperm(6000, generator=torch.Generator().manual_seed(4)).tolist()
    for c in range(10):  # each class's public rows are its first ones in the data_seed permutation
        first = [i for i in order if labels[i] == c][:counts[c]]
        assert sorted(first) == [i for i in dm.public_indices if labels[i] == c]
    public, val, private = set(dm.public_indices), set(dm.val_indices), set(dm.private_indices)
    assert not public & private and not public & val and not val & private
    assert len(public) + len(val) + len(private) == 6000 and len(val) == 600
    rest = [i for i in order if i not in public]
    assert dm.val_indices == sorted(rest[:600])


def test_per_class_defaults_to_equal_weights_and_max_public_caps_the_total():
    labels = [i % 10 for i in range(500)]
    dm = built(labels=labels, public_selection="per_class", public_fraction=0.2)
    assert [sum(labels[i] == c for i in dm.public_indices) for c in range(10)] == [10] * 10
    capped = built(labels=labels, public_selection="per_class", public_fraction=0.2, max_public_samples=15)
    assert [sum(labels[i] == c for i in capped.public_indices) for c in range(10)] == [2] * 5 + [1] * 5


def test_per_class_on_cifar_files_reads_the_modules_labels(tmp_path):
    fake_cifar10(tmp_path, n_per_batch=10)  # 50 training images, labels i % 10 in each batch file
    dm = CIFAR10DataModule(data_dir=str(tmp_path), batch_size=2, verify_checksums=False, public_fraction=0.2,
                           public_selection="per_class")
    dm.setup()
    targets = dm.pool_dataset.targets
    assert sorted(targets[dm.public_indices].tolist()) == list(range(10))
    first = CIFAR10DataModule(data_dir=str(tmp_path), batch_size=2, verify_checksums=False, public_fraction=0.08,
                              public_selection="first")
    first.setup()
    assert first.public_indices == [0, 1, 2, 3] and first.n_private == 46


@pytest.mark.parametrize("kwargs, message", [
    (dict(public_selection="labels"), "Expected `public_selection` in"),
    (dict(public_class_weights=[1.0] * 10), "`public_class_weights` is for public_selection='per_class'"),
    (dict(public_selection="per_class", public_class_weights=[1.0, -0.5]), "`public_class_weights` >= 0"),
    (dict(public_selection="per_class", public_class_weights=[0, 0.0]), "not all zero"),
    (dict(public_selection="per_class", public_class_weights="1,2"), "list of finite numbers"),
])
def test_bad_selection_options_are_refused_in_one_line(kwargs, message):
    with pytest.raises(PrivacyConfigError, match=message) as error:
        LabelledDataModule(labels=[0, 1] * 10, **kwargs)
    assert "\n" not in str(error.value)


def test_refusals_that_need_the_data():
    labels = [0] * 5 + [1] * 50
    with pytest.raises(PrivacyConfigError, match=r"one weight per class \(2\), but got 3"):
        built(labels=labels, num_classes=2, public_selection="per_class", public_class_weights=[1, 1, 1],
              public_fraction=0.2)
    with pytest.raises(ConfigError, match="asks class 0 for 6 public examples, but the pool holds fewer"):
        built(labels=labels, num_classes=2, public_selection="per_class", public_fraction=0.2)  # 11: 6 + 5
    with pytest.raises(ConfigError, match="needs the pool's labels"):
        built(labels=labels, num_classes=2, labels_readable=False, public_selection="per_class", public_fraction=0.1)
    with pytest.raises(ConfigError, match="does not carve whole groups"):
        built(IndexedDataModule, n=30, train_groups=[i // 3 for i in range(30)], public_selection="first",
              public_fraction=0.1)


def old_grouped_carve(pool_size, seed, public_fraction, val_fraction, groups, max_public=None, max_private=None):
    """The carve of grouped pools before ``public_selection`` existed (review 61: copied from 5be0074's ``_carve``)."""
    from datamodules.base import _boundary_at_or_below, _groups_together
    order = _groups_together(torch.randperm(pool_size, generator=torch.Generator().manual_seed(seed)).tolist(), groups)
    n_public = round(public_fraction * pool_size)
    if max_public is not None:
        n_public = min(n_public, max_public)
    n_val = round(val_fraction * pool_size)
    public_end = _boundary_at_or_below(order, groups, n_public, 0)
    val_end = _boundary_at_or_below(order, groups, public_end + n_val, public_end)
    private = order[val_end:]
    if max_private is not None:
        private = private[:max_private]
    return sorted(order[:public_end]), sorted(order[public_end:val_end]), sorted(private)


@pytest.mark.parametrize("seed, public_fraction, val_fraction, max_public, max_private",
                         [(0, 0.2, 0.1, None, None), (5, 0.13, 0.27, 30, 90), (9, 0.0, 0.3, None, None)])
def test_random_selection_of_a_grouped_pool_is_the_carve_it_always_was(seed, public_fraction, val_fraction,
                                                                      max_public, max_private):
    """Groups of 1-7 rows (passages): each cut at the group boundary at or below it, as before (review 61)."""
    sizes = torch.randint(1, 8, (200,), generator=torch.Generator().manual_seed(seed)).tolist()
    groups = [g for g, size in enumerate(sizes) for _ in range(size)][:500]
    dm = built(IndexedDataModule, n=500, train_groups=groups, data_seed=seed, public_fraction=public_fraction,
               val_fraction=val_fraction, max_public_samples=max_public, max_private_samples=max_private)
    expected = old_grouped_carve(500, seed, public_fraction, val_fraction, groups, max_public, max_private)
    assert (dm.public_indices, dm.val_indices, dm.private_indices) == expected
    assert all(len({groups[i] for i in part} & {groups[i] for i in other}) == 0
               for part, other in [(dm.public_indices, dm.val_indices), (dm.public_indices, dm.private_indices)])
