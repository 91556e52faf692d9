"""LightningDataModules with a Poisson-sampled private split and a disjoint public split."""

from datamodules.base import DataSplits, PublicPrivateDataModule, check_disjoint, fixed_test_split
from datamodules.collate import EmptySafeCollate, PadToLongest, empty_like_batch
from datamodules.datasets import ImageTensorDataset, TensorPairDataset, TextDataset
from datamodules.imdb import IMDBDataModule, WordVocabulary
from datamodules.prompt_text import PromptRecords, PromptTextDataModule
from datamodules.qa import QA_TASK_NAMES, QADataModule
from datamodules.synthetic import PhaseRetrievalDataModule, QuadraticDataModule, SyntheticClassificationDataModule
from datamodules.text import MovieReviewsDataModule
from datamodules.text_tasks import TASK_NAMES, VARYING_TASK_NAMES, TaskSpec, get_task, load_task, template_table
from datamodules.vision import (
    CIFAR10DataModule,
    DigitsDataModule,
    MLXtendMNISTDataModule,
    MNISTDataModule,
    TinyImageNetDataModule,
)

__all__ = [
    "CIFAR10DataModule",
    "DataSplits",
    "DigitsDataModule",
    "EmptySafeCollate",
    "IMDBDataModule",
    "ImageTensorDataset",
    "MLXtendMNISTDataModule",
    "MNISTDataModule",
    "MovieReviewsDataModule",
    "PadToLongest",
    "PhaseRetrievalDataModule",
    "PromptRecords",
    "PromptTextDataModule",
    "QuadraticDataModule",
    "PublicPrivateDataModule",
    "QADataModule",
    "QA_TASK_NAMES",
    "SyntheticClassificationDataModule",
    "TASK_NAMES",
    "VARYING_TASK_NAMES",
    "WordVocabulary",
    "TaskSpec",
    "TensorPairDataset",
    "TextDataset",
    "TinyImageNetDataModule",
    "check_disjoint",
    "empty_like_batch",
    "fixed_test_split",
    "get_task",
    "load_task",
    "template_table",
]
