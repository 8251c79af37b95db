"""Training patterns of the keras.io guides, written once for both Kerases.

Each pattern builds a model (seeded), trains it for a few steps on fixed
synthetic data and returns the total weight change, so a test can compare a
mixed-precision run's update with float32's (cosine, norm ratio). ``tiny``
multiplies every loss by 1e-6 and the learning rate by 1e6 (SGD everywhere,
so the update is the same size): unscaled float16 gradients of such a loss
underflow, so a run whose gradients were not loss-scaled is told apart from
one whose were. (At 1e-5 these small models' gradients mostly stay above
float16's subnormals: an unscaled GAN still reached cosine 0.93; at 1e-6, 0.22.)

Also a command line, for runs under ``TFAMP_ENABLE=1`` (which patches the
whole process): ``python tests/patterns.py KERAS PATTERN [--tiny] --out F.npz``.

Patterns:
  gan       overridden ``train_step`` driving two models with their own
            optimizers; ``compile()`` without an optimizer
  wgan_gp   as gan, the critic loss with a gradient penalty through a nested
            GradientTape (non-scalar inner target), optimizers passed to an
            overridden ``compile``
  vae       overridden ``train_step`` on ``self.optimizer``; the
            reconstruction loss is a sum over pixels (keras.io VAE)
  sum_loss  overridden ``train_step`` whose loss is a ``reduce_sum`` over
            every pixel of the batch (no mean): its gradients overflow float16
            at the default start scale, so dynamic scaling must come down
  multi_io  two inputs, two outputs, ``loss_weights`` and
            ``steps_per_execution=4``; Keras's own train step
  per_pixel keras.io ``ddim.py``: an overridden ``train_step`` whose tape
            differentiates the compiled loss function's per-pixel values
            (``mean_absolute_error`` returns one value per pixel: a
            non-scalar target), a ``Mean`` tracker, and an EMA copy of the
            network updated by ``assign`` after the optimizer step; a
            subclassed model (not built before ``fit``)
  contrastive keras.io SimCLR: a per-example contrastive loss vector
            differentiated as is, applied by a second optimizer given to an
            overridden ``compile`` (not the model's), then a linear probe on
            labels with a third optimizer and a scalar loss
  one_channel_norm keras.io's timeseries Transformer: LayerNormalization
            (epsilon 1e-6) over a series' one channel, whose variance gradient
            in 16 bits is a rounding residual times 1e9 where float32's is 0
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys

import numpy as np

TINY_LOSS = 1e-6  # `tiny=True`; a number for `tiny` is the factor itself
BATCH = 16
STEPS = 6


def keras_module(name: str):
    """"tf_keras" or "keras3" -> the module."""
    return importlib.import_module("tf_keras" if name == "tf_keras" else "keras")


def _factor(tiny) -> float:
    """The loss factor of a `tiny` argument: False -> 1, True -> TINY_LOSS, a number -> it."""
    if tiny is True:
        return TINY_LOSS
    return float(tiny) if tiny else 1.0


def _is_keras3(keras) -> bool:
    return keras.__name__ == "keras"


def _grads_and_apply(keras, optimizer, loss, tape, variables):
    """tape.gradient + the optimizer update, written as each Keras's guides do."""
    grads = tape.gradient(loss, variables)
    optimizer.apply_gradients(zip(grads, variables))


def _mlp(keras, inputs: int, outputs: int, name: str, hidden: int = 32):
    x = keras.Input((inputs,))
    h = keras.layers.Dense(hidden, activation="relu")(x)
    h = keras.layers.Dense(hidden, activation="relu")(h)
    return keras.Model(x, keras.layers.Dense(outputs)(h), name=name)


def _gan(keras, tiny: bool, lr: float, penalty: bool):
    import tensorflow as tf

    factor = _factor(tiny)

    class GAN(keras.Model):
        def __init__(self):
            super().__init__()
            self.generator = _mlp(keras, 8, 16, "generator")
            self.critic = _mlp(keras, 16, 1, "critic")

        def call(self, z):
            return self.critic(self.generator(z))

        def compile(self, d_optimizer=None, g_optimizer=None, **kwargs):  # noqa: A003
            super().compile(**kwargs)
            self.d_optimizer = d_optimizer or keras.optimizers.SGD(lr)
            self.g_optimizer = g_optimizer or keras.optimizers.SGD(lr)

        def _penalty(self, real, fake):
            alpha = tf.random.stateless_uniform([tf.shape(real)[0], 1], seed=[3, 4])
            mixed = real + alpha * (fake - real)
            with tf.GradientTape() as inner:
                inner.watch(mixed)
                pred = self.critic(mixed)
            grads = inner.gradient(pred, [mixed])[0]  # a non-scalar target, as keras.io
            norm = tf.sqrt(tf.reduce_sum(tf.square(grads), axis=1) + 1e-12)
            return tf.reduce_mean((norm - 1.0) ** 2)

        def train_step(self, data):
            real = data
            z = tf.random.stateless_normal([tf.shape(real)[0], 8], seed=[1, 2])
            with tf.GradientTape() as tape:
                fake = self.generator(z)
                real_out, fake_out = self.critic(real), self.critic(fake)
                if penalty:
                    d_loss = (tf.reduce_mean(fake_out) - tf.reduce_mean(real_out)
                              + 10.0 * self._penalty(real, fake))
                else:
                    d_loss = (tf.reduce_mean(tf.nn.softplus(-real_out))
                              + tf.reduce_mean(tf.nn.softplus(fake_out)))
                d_loss = d_loss * factor
            _grads_and_apply(keras, self.d_optimizer, d_loss, tape,
                             self.critic.trainable_weights)
            with tf.GradientTape() as tape:
                fake_out = self.critic(self.generator(z))
                if penalty:
                    g_loss = -tf.reduce_mean(fake_out)
                else:
                    g_loss = tf.reduce_mean(tf.nn.softplus(-fake_out))
                g_loss = g_loss * factor
            _grads_and_apply(keras, self.g_optimizer, g_loss, tape,
                             self.generator.trainable_weights)
            return {"d_loss": d_loss, "g_loss": g_loss}

    model = GAN()
    model.compile(keras.optimizers.SGD(lr), keras.optimizers.SGD(lr))
    rng = np.random.default_rng(0)
    data = rng.normal(size=(BATCH * STEPS, 16)).astype("float32")
    return model, (data,), {}


def gan(keras, tiny, lr):
    return _gan(keras, tiny, lr, penalty=False)


def wgan_gp(keras, tiny, lr):
    return _gan(keras, tiny, lr, penalty=True)


def _autoencoder_parts(keras, latent: int):
    x = keras.Input((8, 8, 1))
    h = keras.layers.Conv2D(8, 3, padding="same", activation="relu")(x)
    h = keras.layers.Flatten()(h)
    h = keras.layers.Dense(32, activation="relu")(h)
    encoder = keras.Model(x, keras.layers.Dense(latent * 2)(h), name="encoder")
    z = keras.Input((latent,))
    h = keras.layers.Dense(8 * 8 * 8, activation="relu")(z)
    h = keras.layers.Reshape((8, 8, 8))(h)
    out = keras.layers.Conv2D(1, 3, padding="same")(h)
    decoder = keras.Model(z, out, name="decoder")
    return encoder, decoder


def _images(n: int):
    rng = np.random.default_rng(1)
    return rng.uniform(size=(n, 8, 8, 1)).astype("float32")


def vae(keras, tiny, lr):
    import tensorflow as tf

    factor = _factor(tiny)

    class VAE(keras.Model):
        def __init__(self):
            super().__init__()
            self.encoder, self.decoder = _autoencoder_parts(keras, 4)

        def call(self, x):
            mean, _ = tf.split(self.encoder(x), 2, axis=-1)
            return self.decoder(mean)

        def train_step(self, data):
            x = data[0] if isinstance(data, tuple) else data
            with tf.GradientTape() as tape:
                mean, log_var = tf.split(self.encoder(x), 2, axis=-1)
                eps = tf.random.stateless_normal(tf.shape(mean), seed=[5, 6])
                z = mean + tf.exp(0.5 * log_var) * eps
                logits = self.decoder(z)
                recon = tf.reduce_mean(tf.reduce_sum(
                    tf.nn.sigmoid_cross_entropy_with_logits(labels=x, logits=logits),
                    axis=(1, 2, 3)))
                kl = -0.5 * tf.reduce_mean(tf.reduce_sum(
                    1 + log_var - tf.square(mean) - tf.exp(log_var), axis=1))
                loss = (recon + kl) * factor
            _grads_and_apply(keras, self.optimizer, loss, tape, self.trainable_weights)
            return {"loss": loss}

    model = VAE()
    model.compile(optimizer=keras.optimizers.SGD(lr))
    return model, (_images(BATCH * STEPS),), {}


def sum_loss(keras, tiny, lr):
    import tensorflow as tf

    factor = _factor(tiny)

    class SumLoss(keras.Model):
        def __init__(self):
            super().__init__()
            self.encoder, self.decoder = _autoencoder_parts(keras, 8)

        def call(self, x):
            return self.decoder(self.encoder(x)[:, :8])

        def train_step(self, data):
            x = data[0] if isinstance(data, tuple) else data
            with tf.GradientTape() as tape:  # gradients up to ~40: 2^15 overflows
                loss = tf.reduce_sum(tf.square(self(x) - x)) * factor
            _grads_and_apply(keras, self.optimizer, loss, tape, self.trainable_weights)
            return {"loss": loss}

    model = SumLoss()
    model.compile(optimizer=keras.optimizers.SGD(lr * 1e-3))
    # Twice the steps: dynamic scaling must first come down from 2^15.
    return model, (_images(BATCH * STEPS * 2),), {}


def multi_io(keras, tiny, lr):
    factor = _factor(tiny)
    a, b = keras.Input((12,), name="a"), keras.Input((6,), name="b")
    h = keras.layers.Concatenate()([keras.layers.Dense(16, activation="relu")(a), b])
    h = keras.layers.Dense(32, activation="relu")(h)
    out1 = keras.layers.Dense(1, name="reg")(h)
    out2 = keras.layers.Dense(3, name="cls")(h)
    model = keras.Model([a, b], [out1, out2])
    model.compile(optimizer=keras.optimizers.SGD(lr),
                  loss={"reg": "mse", "cls": keras.losses.SparseCategoricalCrossentropy(
                      from_logits=True)},
                  loss_weights={"reg": 0.5 * factor, "cls": 2.0 * factor},
                  steps_per_execution=4)
    rng = np.random.default_rng(2)
    n = BATCH * 8
    xa = rng.normal(size=(n, 12)).astype("float32")
    xb = rng.normal(size=(n, 6)).astype("float32")
    y1 = xa[:, :3].sum(axis=1, keepdims=True)
    y2 = rng.integers(0, 3, size=(n,)).astype("int64")
    return model, ({"a": xa, "b": xb}, {"reg": y1, "cls": y2}), {}


def per_pixel(keras, tiny, lr):
    import tensorflow as tf

    factor = _factor(tiny)

    class Diffusion(keras.Model):
        def __init__(self):
            super().__init__()
            self.network = _conv_net(keras, "network")
            self.ema_network = _conv_net(keras, "ema_network")
            self.noise_loss_tracker = keras.metrics.Mean(name="n_loss")

        @property
        def metrics(self):
            return [self.noise_loss_tracker]

        def call(self, x):
            return self.network(x)

        def train_step(self, images):
            images = images[0] if isinstance(images, tuple) else images
            noises = tf.random.stateless_normal(tf.shape(images), seed=[7, 8])
            with tf.GradientTape() as tape:
                pred_noises = self.network(images + 0.5 * noises, training=True)
                noise_loss = self.loss(noises, pred_noises) * factor  # one per pixel
            gradients = tape.gradient(noise_loss, self.network.trainable_weights)
            self.optimizer.apply_gradients(
                zip(gradients, self.network.trainable_weights, strict=True))
            self.noise_loss_tracker.update_state(noise_loss)
            for weight, ema_weight in zip(self.network.weights, self.ema_network.weights,
                                          strict=True):
                ema_weight.assign(0.999 * ema_weight + (1 - 0.999) * weight)
            return {m.name: m.result() for m in self.metrics}

    model = Diffusion()
    # The gradient of a per-pixel target is that of its sum over the batch's pixels.
    model.compile(optimizer=keras.optimizers.SGD(lr * 1e-3),
                  loss=keras.losses.mean_absolute_error)
    return model, (_images(BATCH * STEPS),), {}


def _conv_net(keras, name: str):
    x = keras.Input((8, 8, 1))
    h = keras.layers.Conv2D(8, 3, padding="same", activation="relu")(x)
    return keras.Model(x, keras.layers.Conv2D(1, 3, padding="same")(h), name=name)


def contrastive(keras, tiny, lr):
    import tensorflow as tf

    factor = _factor(tiny)
    temperature = 1.0

    class Contrastive(keras.Model):
        def __init__(self):
            super().__init__()
            self.encoder = _mlp(keras, 16, 16, "encoder")
            self.projection_head = _mlp(keras, 16, 8, "projection_head", hidden=16)
            self.linear_probe = keras.Sequential(
                [keras.Input((16,)), keras.layers.Dense(4)], name="linear_probe")
            self.contrastive_loss_tracker = keras.metrics.Mean(name="c_loss")
            self.probe_loss_tracker = keras.metrics.Mean(name="p_loss")

        def call(self, x):
            return self.linear_probe(self.encoder(x))

        def compile(self, contrastive_optimizer=None, probe_optimizer=None, **kwargs):  # noqa: A003
            super().compile(**kwargs)
            self.contrastive_optimizer = contrastive_optimizer
            self.probe_optimizer = probe_optimizer

        @property
        def metrics(self):
            return [self.contrastive_loss_tracker, self.probe_loss_tracker]

        def contrastive_loss(self, projections_1, projections_2):
            projections_1 = tf.math.l2_normalize(projections_1, axis=1)
            projections_2 = tf.math.l2_normalize(projections_2, axis=1)
            similarities = tf.matmul(projections_1, projections_2, transpose_b=True)
            similarities = similarities / temperature
            batch_size = tf.shape(projections_1)[0]
            labels = tf.range(batch_size)
            loss_1_2 = keras.losses.sparse_categorical_crossentropy(
                labels, similarities, from_logits=True)
            loss_2_1 = keras.losses.sparse_categorical_crossentropy(
                labels, tf.transpose(similarities), from_logits=True)
            return (loss_1_2 + loss_2_1) / 2  # one value per example

        def train_step(self, data):
            images, labels = data
            view_1 = images + tf.random.stateless_normal(tf.shape(images), seed=[1, 1]) * 0.3
            view_2 = images + tf.random.stateless_normal(tf.shape(images), seed=[2, 2]) * 0.3
            with tf.GradientTape() as tape:
                projections_1 = self.projection_head(self.encoder(view_1, training=True))
                projections_2 = self.projection_head(self.encoder(view_2, training=True))
                contrastive_loss = self.contrastive_loss(projections_1, projections_2)
                contrastive_loss = contrastive_loss * factor
            weights = (self.encoder.trainable_weights
                       + self.projection_head.trainable_weights)
            gradients = tape.gradient(contrastive_loss, weights)  # a vector target
            self.contrastive_optimizer.apply_gradients(zip(gradients, weights, strict=True))
            self.contrastive_loss_tracker.update_state(contrastive_loss)
            features = tf.stop_gradient(self.encoder(images, training=False))
            with tf.GradientTape() as tape:
                logits = self.linear_probe(features, training=True)
                probe_loss = keras.losses.sparse_categorical_crossentropy(
                    labels, logits, from_logits=True)
                probe_loss = tf.reduce_mean(probe_loss) * factor
            gradients = tape.gradient(probe_loss, self.linear_probe.trainable_weights)
            self.probe_optimizer.apply_gradients(
                zip(gradients, self.linear_probe.trainable_weights, strict=True))
            self.probe_loss_tracker.update_state(probe_loss)
            return {m.name: m.result() for m in self.metrics}

    model = Contrastive()
    # A small step: the contrastive loss of a from-scratch encoder is rough, and six
    # steps of 1e-2 already take float32 and float16 apart (cosine 0.85 at loss x1).
    model.compile(contrastive_optimizer=keras.optimizers.SGD(lr * 0.1),
                  probe_optimizer=keras.optimizers.SGD(lr))
    rng = np.random.default_rng(3)
    x = rng.normal(size=(BATCH * STEPS, 16)).astype("float32")
    y = rng.integers(0, 4, size=(BATCH * STEPS,)).astype("int64")
    return model, (x, y), {}


def one_channel_norm(keras, tiny, lr):
    layers = keras.layers
    factor = _factor(tiny)
    inputs = keras.Input((32, 1))
    x = inputs
    for _ in range(2):  # keras.io's encoder block, its series one channel wide
        h = layers.MultiHeadAttention(key_dim=8, num_heads=2)(x, x)
        h = layers.LayerNormalization(epsilon=1e-6)(h)
        res = h + x
        h = layers.Conv1D(4, 1, activation="relu")(res)
        h = layers.Conv1D(1, 1)(h)
        x = layers.LayerNormalization(epsilon=1e-6)(h) + res
    x = layers.GlobalAveragePooling1D()(x)
    outputs = layers.Dense(2, activation="softmax")(layers.Dense(16, activation="relu")(x))
    model = keras.Model(inputs, outputs)

    def loss(y_true, y_pred):
        return keras.losses.sparse_categorical_crossentropy(y_true, y_pred) * factor

    model.compile(optimizer=keras.optimizers.SGD(lr), loss=loss)
    rng = np.random.default_rng(0)
    n = BATCH * STEPS
    return model, (rng.normal(size=(n, 32, 1)).astype("float32"),
                   rng.integers(0, 2, size=(n,))), {}


PATTERNS = {"gan": gan, "wgan_gp": wgan_gp, "vae": vae, "sum_loss": sum_loss,
            "multi_io": multi_io, "per_pixel": per_pixel, "contrastive": contrastive,
            "one_channel_norm": one_channel_norm}
LEARNING_RATE = 1e-2


def build(keras, pattern: str, tiny: bool = False):
    """(model, fit arguments) for `pattern`, seeded: the same weights in every run."""
    keras.utils.set_random_seed(0)
    lr = LEARNING_RATE / _factor(tiny)
    return PATTERNS[pattern](keras, tiny, lr)


def train(keras, pattern: str, *, tiny: bool = False, before_fit=None) -> dict:
    """Trains `pattern` (one epoch of a few steps); returns what the tests compare.

    Args:
      before_fit: called with the compiled model (e.g. ``tfamp.enable``).

    Returns:
      {"delta": the concatenated weight change, "dtypes": the variables'
      dtypes, "steps": the number of batches, "history": fit's history (last
      values)}.
    """
    model, data, kwargs = build(keras, pattern, tiny)
    if before_fit is not None:
        before_fit(model)
    x = data[0]
    y = data[1] if len(data) > 1 else None
    before = [np.array(v.numpy(), copy=True) for v in model.trainable_weights]
    history = model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0, **kwargs)
    delta = np.concatenate([(np.asarray(v.numpy()) - w).ravel()
                            for v, w in zip(model.trainable_weights, before, strict=True)])
    dtypes = sorted({_dtype_name(v) for v in model.weights})
    size = len(next(iter(x.values())) if isinstance(x, dict) else x)
    return {"delta": delta, "dtypes": dtypes, "steps": -(-size // BATCH),
            "history": {k: float(v[-1]) for k, v in history.history.items()}}


def _dtype_name(variable) -> str:
    dtype = variable.dtype
    return dtype if isinstance(dtype, str) else dtype.name


def compare(reference: np.ndarray, delta: np.ndarray) -> tuple[float, float]:
    """(cosine, norm ratio) of a run's weight change against float32's."""
    norm_ref, norm = float(np.linalg.norm(reference)), float(np.linalg.norm(delta))
    if norm_ref == 0.0 or norm == 0.0:
        return 0.0, norm / norm_ref if norm_ref else float("inf")
    return float(reference @ delta) / (norm_ref * norm), norm / norm_ref


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("keras", choices=["tf_keras", "keras3"])
    parser.add_argument("patterns", nargs="+", choices=sorted(PATTERNS))
    parser.add_argument("--tiny", nargs="?", const=True, default=False, type=float,
                        help="multiply the loss by 1e-6, or by the number given")
    parser.add_argument("--out", required=True, help="an .npz file for the results")
    args = parser.parse_args(argv)
    keras = keras_module(args.keras)
    arrays, meta = {}, {}
    for pattern in args.patterns:
        result = train(keras, pattern, tiny=args.tiny)
        arrays[pattern] = result["delta"]
        meta[pattern] = {"dtypes": result["dtypes"], "steps": result["steps"],
                         "history": result["history"]}
    np.savez(args.out, meta=json.dumps(meta), **arrays)
    return 0


if __name__ == "__main__":
    sys.exit(main())
