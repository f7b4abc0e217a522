"""One task of a TensorFlow 2 parameter-server job (tests/tests/frameworks_tf.rs).

Run with the venv of .ci/install-deps (/opt/flowlane-ml/bin/python). The task
is told its role by TF_CONFIG, as on Kubernetes (TFJob sets it the same way):

- "ps" and "worker" tasks start a tf.distribute.Server (gRPC) and serve
  until killed. In TF2's ParameterServerStrategy the workers hold no
  training loop: they run the functions the coordinator sends them.
- the "chief" task is the coordinator: it builds the model's variables on
  the parameter servers (round-robin over the PS tasks), schedules the
  training steps on the workers through a ClusterCoordinator, and reports.

The model: an MLP 64-256-256-1 (~82k float32 parameters) learning a fixed
teacher (tanh of a linear map) from synthetic batches. Batch i is a pure
function of i (stateless random ops), so a job with one worker is
deterministic (its steps run one after the other on one worker: the final
parameters are bit-identical whatever lane carries the bytes).

Two phases:
1. Round-robin (deterministic, any number of workers): SYNC_STEPS steps, step
   s placed by the coordinator on worker s mod W (a device scope, as the
   ClusterCoordinator itself places a closure) and awaited before the next.
   Every worker reads and updates every PS in turn, one step at a time, so
   the parameters after this phase are bit-identical whatever lane carries
   the bytes: the check that no byte of any channel changed.
2. Asynchronous (the ClusterCoordinator as users run it): STEPS steps
   scheduled at once. With more than one worker the order in which updates
   land on the PS depends on timing, so the final parameters vary from run
   to run on any lane; only one worker makes this phase deterministic.

Timing: step 0 of phase 2 is scheduled and joined alone (it traces the
function and ships it to the workers); steps/s counts steps 1..N-1.

The chief prints "READY" once imported and waits for a line on stdin
before it connects. Output of the chief: one JSON line, then "HOLD"; it then keeps every channel
open until a line arrives on stdin (the test counts the job's connections
and the daemons' channels meanwhile).
"""
import hashlib
import json
import os
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

STEPS = int(os.environ.get("FL_STEPS", "200"))
SYNC_STEPS = int(os.environ.get("FL_SYNC_STEPS", "60"))
BATCH = 128
D, H = 64, 256
LR = float(os.environ.get("FL_LR", "0.1"))
WORKERS = 1  # set from the cluster spec in main()


def main():
    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(2)
    resolver = tf.distribute.cluster_resolver.TFConfigClusterResolver()
    if resolver.task_type in ("ps", "worker"):
        server = tf.distribute.Server(
            resolver.cluster_spec(),
            job_name=resolver.task_type,
            task_index=resolver.task_id,
            protocol="grpc",
            start=True,
        )
        print("SERVING", flush=True)
        server.join()
        return
    coordinate(resolver)


def coordinate(resolver):
    # Imported and ready: wait for the go (the test starts the chief with
    # the servers, and says go once every server listens: a connect to a
    # port nobody listens on yet would stay on TCP).
    print("READY", flush=True)
    sys.stdin.readline()
    global WORKERS
    WORKERS = max(1, len(resolver.cluster_spec().as_dict().get("worker", [])))
    strategy = tf.distribute.experimental.ParameterServerStrategy(resolver)
    coordinator = tf.distribute.experimental.coordinator.ClusterCoordinator(strategy)
    rng = np.random.default_rng(1234)

    def init(shape, scale):
        return (rng.standard_normal(shape) * scale).astype(np.float32)

    with strategy.scope():
        params = [
            tf.Variable(init((D, H), 1 / np.sqrt(D)), name="w1"),
            tf.Variable(np.zeros(H, np.float32), name="b1"),
            tf.Variable(init((H, H), 1 / np.sqrt(H)), name="w2"),
            tf.Variable(np.zeros(H, np.float32), name="b2"),
            tf.Variable(init((H, 1), 1 / np.sqrt(H)), name="w3"),
            tf.Variable(np.zeros(1, np.float32), name="b3"),
        ]
    teacher = tf.constant(init((D, 1), 1.0))

    def batch(step, n):
        seed = tf.stack([tf.cast(step, tf.int64), tf.constant(7, tf.int64)])
        x = tf.random.stateless_normal([n, D], seed=seed)
        y = tf.tanh(x @ teacher)
        return x, y

    def forward(p, x):
        h = tf.nn.relu(x @ p[0] + p[1])
        h = tf.nn.relu(h @ p[2] + p[3])
        return h @ p[4] + p[5]

    def sgd_step(batch_index, lr):
        x, y = batch(batch_index, BATCH)
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(forward(params, x) - y))
        grads = tape.gradient(loss, params)
        for v, g in zip(params, grads):
            v.assign_sub(lr * g)
        return loss

    @tf.function
    def train_step(step):
        # Linear decay to 0: the last updates are small, so where the run
        # ends depends little on the order of the asynchronous updates.
        # Divided by the workers: their updates land asynchronously on
        # parameters up to W-1 updates stale, and with the single-worker
        # rate 3 workers diverged (NaN) in one run on a quiet machine (the
        # usual rule for asynchronous SGD). One worker keeps LR unchanged.
        return sgd_step(step, LR / WORKERS * (1.0 - tf.cast(step, tf.float32) / STEPS))

    @tf.function
    def worker_fn(step):
        return strategy.run(train_step, args=(step,))

    @tf.function
    def sync_step(step):
        # Its own batches (indices from 10**5) and its own decay.
        lr = LR * (1.0 - tf.cast(step, tf.float32) / SYNC_STEPS)
        return sgd_step(step + 10**5, lr)

    # Evaluated on the coordinator from the parameters it reads back
    # from the PS tasks: one fixed batch, never trained on.
    x_eval, y_eval = batch(tf.constant(10**6, tf.int64), 1024)

    def eval_loss():
        p = [v.read_value() for v in params]
        return float(tf.reduce_mean(tf.square(forward(p, x_eval) - y_eval)).numpy())

    def params_sha256():
        h = hashlib.sha256()
        for v in params:
            h.update(v.read_value().numpy().tobytes())
        return h.hexdigest()

    loss0 = eval_loss()
    # Phase 1, round-robin: the same arithmetic in the same order on every
    # lane. The step's learning rate is the single-worker one (one update
    # at a time, nothing stale), decaying over this phase alone.
    for s in range(SYNC_STEPS):
        with tf.device(f"/job:worker/replica:0/task:{s % WORKERS}"):
            out = sync_step(tf.constant(s, tf.int64))
        out.numpy()  # awaits the step, its updates included
    loss_sync = eval_loss()
    sha_sync = params_sha256()
    t0 = time.perf_counter()
    coordinator.schedule(worker_fn, args=(tf.constant(0, tf.int64),))
    coordinator.join()
    warm_s = time.perf_counter() - t0
    t1 = time.perf_counter()
    for s in range(1, STEPS):
        coordinator.schedule(worker_fn, args=(tf.constant(s, tf.int64),))
    coordinator.join()
    dt = time.perf_counter() - t1
    loss1 = eval_loss()
    spec = resolver.cluster_spec().as_dict()
    print(
        json.dumps(
            {
                "ps": len(spec.get("ps", [])),
                "workers": len(spec.get("worker", [])),
                "steps": STEPS,
                "steps_per_s": (STEPS - 1) / dt,
                "first_step_s": warm_s,
                # A diverged run reports null, not NaN (which is no JSON).
                "eval_loss_first": loss0 if np.isfinite(loss0) else None,
                "eval_loss_sync": loss_sync if np.isfinite(loss_sync) else None,
                "eval_loss_last": loss1 if np.isfinite(loss1) else None,
                "sync_steps": SYNC_STEPS,
                "params_sha256_sync": sha_sync,
                "params_sha256": params_sha256(),
            }
        ),
        flush=True,
    )
    print("HOLD", flush=True)
    sys.stdin.readline()


if __name__ == "__main__":
    main()
