"""The recipes' networks (plain ``torch.nn``; every size a parameter)."""

from recipes.models.resnets import ResNet, WideResNet, cifar_resnet, resnet18_cifar, torchvision_model
from recipes.models.sequence import LSTMClassifier, Seq2SeqTransformer

__all__ = [
    "LSTMClassifier",
    "ResNet",
    "Seq2SeqTransformer",
    "WideResNet",
    "cifar_resnet",
    "resnet18_cifar",
    "torchvision_model",
]
