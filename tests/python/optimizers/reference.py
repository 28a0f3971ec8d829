"""NumPy references of the lazy sparse optimizers, written from the Keras 3
formulas: sum duplicate rows, then update only those rows (float64)."""
import numpy as np


def _dedup(indices, grads):
    rows = np.unique(indices)
    summed = np.stack([grads[indices == r].sum(0) for r in rows])
    return rows, summed.astype(np.float64)


class NumpyOptimizer:
    def __init__(self, name, table, lr, **hp):
        self.name, self.w, self.lr, self.hp = name, table.astype(np.float64), lr, hp
        shape = table.shape
        init = hp.get("initial_accumulator_value", 0.0)
        self.s = {k: np.zeros(shape) for k in ("m", "v", "mom", "mg", "lin", "u", "ag", "ad")}
        self.s["acc"] = np.full(shape, init if name in ("adagrad", "ftrl") else 0.0)
        self.step = np.zeros(shape[0])

    def apply(self, indices, grads):
        rows, g = _dedup(indices, grads)
        h, lr, w, s = self.hp, self.lr, self.w, self.s
        for r, gr in zip(rows, g):
            if self.name == "sgd":
                w[r] -= lr * gr
            elif self.name == "momentum":
                s["mom"][r] = h["momentum"] * s["mom"][r] - lr * gr
                w[r] += h["momentum"] * s["mom"][r] - lr * gr if h.get("nesterov") else s["mom"][r]
            elif self.name == "adagrad":
                s["acc"][r] += gr * gr
                w[r] -= lr * gr / np.sqrt(s["acc"][r] + h["epsilon"])
            elif self.name == "adam":
                self.step[r] += 1
                t = self.step[r]
                b1, b2 = h["beta_1"], h["beta_2"]
                s["m"][r] = b1 * s["m"][r] + (1 - b1) * gr
                s["v"][r] = b2 * s["v"][r] + (1 - b2) * gr * gr
                alpha = lr * np.sqrt(1 - b2 ** t) / (1 - b1 ** t)
                w[r] -= alpha * s["m"][r] / (np.sqrt(s["v"][r]) + h["epsilon"])
            elif self.name == "adamax":
                self.step[r] += 1
                b1 = h["beta_1"]
                s["m"][r] = b1 * s["m"][r] + (1 - b1) * gr
                s["u"][r] = np.maximum(h["beta_2"] * s["u"][r], np.abs(gr))
                w[r] -= lr * s["m"][r] / ((1 - b1 ** self.step[r]) * (s["u"][r] + h["epsilon"]))
            elif self.name == "adadelta":
                rho, eps = h["rho"], h["epsilon"]
                s["ag"][r] = rho * s["ag"][r] + (1 - rho) * gr * gr
                delta = -np.sqrt(s["ad"][r] + eps) / np.sqrt(s["ag"][r] + eps) * gr
                s["ad"][r] = rho * s["ad"][r] + (1 - rho) * delta * delta
                w[r] += lr * delta
            elif self.name == "ftrl":
                p = h["learning_rate_power"]
                g2 = gr + 2 * h["l2_shrinkage_regularization_strength"] * w[r]
                new_acc = s["acc"][r] + gr * gr
                sigma = (new_acc ** -p - s["acc"][r] ** -p) / lr
                s["lin"][r] += g2 - sigma * w[r]
                quad = new_acc ** -p / lr + 2 * h["l2_regularization_strength"]
                l1 = h["l1_regularization_strength"]
                lin = s["lin"][r]
                w[r] = np.where(np.abs(lin) > l1, (np.clip(lin, -l1, l1) - lin) / quad, 0.0)
                s["acc"][r] = new_acc
            elif self.name == "rmsprop":
                rho = h["rho"]
                s["v"][r] = rho * s["v"][r] + (1 - rho) * gr * gr
                denom = s["v"][r] + h["epsilon"]
                if h.get("centered"):
                    s["mg"][r] = rho * s["mg"][r] + (1 - rho) * gr
                    denom = s["v"][r] - s["mg"][r] ** 2 + h["epsilon"]
                inc = lr * gr / np.sqrt(denom)
                if h.get("momentum", 0) > 0:
                    s["mom"][r] = h["momentum"] * s["mom"][r] + inc
                    w[r] -= s["mom"][r]
                else:
                    w[r] -= inc
