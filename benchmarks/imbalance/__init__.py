"""Lightning benchmark: eager-SGD against DDP, post-local SGD and a no-communication bound under load imbalance.

One invocation runs, on 4 CPU ranks (``Trainer(accelerator="cpu", devices=4)``,
Lightning's popen launcher, gloo over loopback), every configuration below on
the same task, from the same seed, for the same number of steps and samples
per rank:

=================================  ==========================================================  =========
configuration                      strategy                                                    imbalance
=================================  ==========================================================  =========
``ddp_balanced``                   ``strategy="ddp"``                                          no
``eager_sgd_balanced``             ``strategy="eager_sgd"`` (solo, max_staleness=1)            no
``ddp_imbalanced``                 ``strategy="ddp"``                                          yes
``post_local_sgd_imbalanced``      post-local SGD (``baselines.PostLocalSGDStrategy``)         yes
``eager_sgd_imbalanced``           ``strategy="eager_sgd"`` (solo, max_staleness=1)            yes
``eager_sgd_majority_imbalanced``  ``strategy="eager_sgd_majority"``                           yes
``eager_sgd_unbounded_imbalanced`` ``EagerSGDStrategy(max_staleness=None)``                    yes
``eager_sgd_contrib_imbalanced``   ``EagerSGDStrategy(normalize="contributors")``              yes
``eager_sgd_s2_imbalanced``        ``EagerSGDStrategy(max_staleness=2)``                       yes
``wagma_sgd_imbalanced``           ``strategy="wagma_sgd"`` (S=2, tau=5)                       yes
``ds_sync_imbalanced``             ``strategy="ds_sync"`` (G=2, max_staleness=1)               yes
``ds_sync_s4_imbalanced``          ``DSSyncStrategy(max_staleness=4)``                         yes
``no_comm_imbalanced``             every rank alone (``baselines.NoCommStrategy``): the bound  yes
=================================  ==========================================================  =========

The staleness-rule study (``docs/staleness.md``) adds configurations that run
only when ``--only`` names them: ``eager_sgd_rule_none_imbalanced`` (the
paper's ``staleness_rule="none"`` at the default bound),
``eager_sgd_unbounded_none_imbalanced`` (the paper's solo: unbounded, rule
``none``), ``eager_sgd_inverse_imbalanced``, ``eager_sgd_unbounded_inverse_imbalanced``,
``eager_sgd_s4_inverse_imbalanced``, ``eager_sgd_s6_inverse_imbalanced``,
``eager_sgd_momentum_imbalanced``, ``eager_sgd_unbounded_momentum_imbalanced``,
``eager_sgd_s4_momentum_imbalanced`` (rule ``"momentum"``),
``eager_sgd_unbounded_drop_imbalanced`` (fresh-only rounds) and
``eager_sgd_backup_imbalanced`` (``strategy="eager_sgd_backup"``: a round waits
for 3 of the 4 ranks); weight prediction off (the strategy's default is on):
``eager_sgd_no_prediction_imbalanced``, ``eager_sgd_unbounded_no_prediction_imbalanced``,
``eager_sgd_backup_no_prediction_imbalanced``; and with it on,
``eager_sgd_s3_imbalanced``, ``eager_sgd_s4_imbalanced`` (``max_staleness=3``, ``4``) and
``eager_sgd_unbounded_rule_none_imbalanced``; ``wagma_sgd_no_scaling_imbalanced`` and
``ds_sync_no_scaling_imbalanced`` (``adaptive_scaling="none"``: meaningful with
``--optimizer adamw``, where the default rescales the local Adam steps);
``wagma_sgd_global5_imbalanced`` and ``wagma_sgd_global10_imbalanced`` (``global_every``
5, the default, and 10); local steps between the rounds (``average_every=4``,
``docs/staleness.md#local-steps-between-rounds``): ``global_local4_imbalanced``
(``WAGMAStrategy(group_size=4, global_every=None, average_every=4)``: wait-avoiding local SGD, one
group of every rank), ``global_local4_s2_imbalanced`` (the same, ``max_staleness=2``),
``wagma_sgd_local4_imbalanced`` and ``ds_sync_local4_imbalanced`` (each strategy's defaults with
``average_every=4``), and what activates the one group's rounds
(``docs/staleness.md#what-activates-the-rounds-of-local-steps``): ``global_local4_majority_imbalanced``,
``global_local4_quorum3_imbalanced`` (``mode="quorum", quorum=3``: ``backup_workers=1`` at 4 ranks),
``global_local2_quorum3_imbalanced`` and ``global_local8_quorum3_imbalanced`` (the same with
``average_every=2`` and ``8``),
``global_local4_sync_imbalanced`` and ``global_local4_sync_s1_imbalanced`` (``mode="sync"``, the
latter with ``max_staleness=1``); overlapped rounds
(``overlap=True``, ``docs/staleness.md#overlapped-rounds``): ``eager_sgd_overlap_imbalanced``
(re-timed), ``eager_sgd_overlap_inverse_imbalanced`` (rule ``"inverse"``: not re-timed),
``eager_sgd_overlap_unbounded_imbalanced``, ``eager_sgd_overlap_s4_imbalanced``,
``eager_sgd_overlap_balanced`` and ``eager_sgd_backup_overlap_imbalanced``. The strategy's
default rule is ``"auto"``: ``"inverse"`` under momentum. ABS-SGD under the same stragglers:
``abs_sgd_imbalanced`` (``strategy="abs_sgd"``), ``abs_sgd_delay1_imbalanced`` (``delay=1``, for
``--optimizer adamw``, where the default is 0), ``abs_sgd_t768_imbalanced``, ``abs_sgd_t1152_imbalanced``,
``abs_sgd_t1536_imbalanced`` (``target_samples``: fewer, larger rounds) and
``abs_sgd_delay1_t768_imbalanced``, and the update rule off at 768: ``abs_sgd_t768_no_prediction_imbalanced``
(``weight_prediction=False``), ``abs_sgd_t768_rule_none_imbalanced`` (``staleness_rule="none"``); its ranks draw different numbers of batches, so its fits are bounded by
epochs (``--steps`` x 4 x ``--batch-size`` must be whole epochs of the data: ``--steps 256``), and the
replicas are compared at the end of fit only. Catching up (``catch_up=True``,
``docs/staleness.md#catching-up``): ``eager_sgd_catch_up_imbalanced`` (the default bound),
``eager_sgd_catch_up_{s2,s3,s4,unbounded}_imbalanced`` and the reference
``eager_sgd_final_sync0_imbalanced``; their ranks skip batches, so their fits run until the rounds
have summed the batches the others train in ``--steps`` (at most 3 x ``--steps`` rounds), without
a synchronous finish, and need ``--schedule constant``; run them with ``--straggle-at backward``
(every configuration then sleeps as part of a batch's compute). ``--optimizer adamw``
trains every configuration with AdamW (``betas=(--momentum, 0.999)``) instead of SGD.

**Task.** 10-class classification of ``x ~ N(0, I_32)`` labelled by a fixed
random teacher MLP (32-64-10, tanh; ~78% is reachable in a few hundred
steps); 131,072 training and 8,192 held-out samples, generated from the seed
on every rank. The student is an MLP 32-512-512-512-10 (ReLU, no buffers,
0.55 M parameters: a 2.1 MB gradient), trained with SGD (lr 0.05, momentum
0.9; DDP reaches the same accuracy with lr 0.1, but a one-step-stale gradient
costs several points more there) and a cosine learning-rate decay to 0 over
the ``--steps`` (``--schedule constant`` keeps lr fixed: then the fit ends
mid-descent and the comparison of accuracies measures how far each strategy
got, where stale gradients under momentum 0.9 cost unbounded solo
eager-SGD 6-18 points); per-rank batch ``--batch-size`` (384: about 20-25 ms of
single-thread forward + backward + step on this machine).

**Imbalance.** ``lightning_partial.callbacks.LoadImbalance``: at every batch,
1 of the 4 ranks, drawn with a shared seed (identical on every rank), sleeps
``D`` before its forward pass. ``D = 2 x`` the mean per-step compute time of a
rank *as it runs in these fits*: 4 ranks share 2 cores here, so a rank's step
takes at least twice its single-process time. The parent calibrates it by
running the model's forward + backward + SGD step (``torch.set_num_threads(N)``, ``--threads``)
in 4 concurrent processes (median of 5 short rounds; the single-process figure
is reported beside it); ``--delay-ms`` overrides it. A sleeping rank frees CPU
for the other three, so on this machine the fast ranks compute faster while a
straggler sleeps; that is a property of the shared CPU, not of the algorithms,
and it affects every imbalanced configuration alike.

**Threads.** ``--threads N`` (default 1) gives every rank, and each
calibration process (which models the ranks as they run), ``N`` intra-op
threads (``OMP_NUM_THREADS``, ``MKL_NUM_THREADS``, ``torch.set_num_threads``).
With 1 thread per rank and fewer cores than ranks (4 ranks on 2 cores here),
gloo's CPU per collective comes out of the ranks' compute; on a machine with
at least ``4 x N`` cores plus a few for the communication threads (e.g. 16
cores, ``--threads 3``) it no longer does. The injected imbalance is a fixed
sleep of ``D`` (``LoadImbalance(delay_ms=...)``), whatever the thread count:
the callback measures compute only for ``speed`` factors, which are not used
here. ``threads`` is recorded in the JSON (``settings`` and ``environment``).

**Emulated devices.** ``--device-ms-per-sample X`` (default 0) adds ``X`` ms per
sample of sleep after every backward, on every rank and in every configuration,
as an accelerator's compute during which the host's cores stay free
(``benchmarks.harness.emulated_device``); the calibrated ``D`` then covers it
(``2 x`` (the concurrent step + ``X x`` the batch)). Recorded in ``settings``.

**Measurements** (per rank, then summarised): the wall time of the training
steps, from the rank's first ``on_train_batch_start`` (before the injected
delay) to the end of the strategy's ``on_train_end`` (after eager-SGD's final
flush and post-local SGD's final average), so Lightning's start-up is
excluded; steps per second (mean over ranks and rank 0's); total samples per
second (sum over ranks); ratios to DDP under the same balance condition and to
the no-communication bound; the training loss (rank 0's last 20 batches, and
rank 0's final model on 8,192 training samples) and held-out accuracy of rank
0's final model, evaluated after the fit. Two checks per fit:

* a parameter digest (float64 sum) after each of the first ``--digest-steps``
  optimizer steps, compared across ranks: the replicas must be identical after
  every step under DDP and eager-SGD; under post-local SGD after the warm-up
  steps and right after every averaging step only; under WAGMA-SGD after every
  ``global_every``-th step (its global average; 5 by default); under DS-Sync (no periodic global average)
  and the bound never;
* the calls into ``torch.distributed`` collectives on the default group, per
  step (Python-level: Lightning's per-batch broadcast, DDP comm hooks, the
  model averager; DDP's C++ gradient allreduce without a hook is not seen).

For eager-SGD, the engine's per-round statistics (fresh gradients,
contributions, staleness, time blocked in ``arrive``) are summarised too.
Also per fit: the CPU time of every rank's process (all its threads) per
sample, over the same interval, and the share of the machine's CPU time the
hypervisor stole meanwhile (``/proc/stat``). With 4 ranks on 2 cores the fits
are CPU-bound, so a strategy's throughput relative to the bound is roughly
at most the bound's CPU per sample over the strategy's (roughly: CPU time per
sample itself varies with contention). This machine is a VM whose
host is shared: a fit during which more than ``--max-steal`` (5%) of the CPU
was stolen runs again, up to ``--steal-retries`` (2) more times.

**Baselines** (see ``benchmarks/baselines.py``): post-local SGD is Lightning's
``DDPStrategy`` with ``PostLocalSGDState`` / ``post_localSGD_hook`` and
``model_averaging_period=4`` (Lightning's ``PeriodicModelAverager`` path), with
the hook registered on CPU too (Lightning registers it only on CUDA), each rank
alone in its post-warm-up subgroup, ``--localsgd-warmup`` steps of plain DDP
first, and one last average at the end of the fit. The bound is DDP with a
no-op comm hook and no averaging. Post-local SGD and the bound have
Lightning's per-batch SIGTERM broadcast (a ``dist.broadcast`` from rank 0 at
every batch: a global synchronisation per step) replaced by a local check, as
eager-SGD has; plain DDP keeps it (it synchronises every step anyway).

Each configuration is one 4-process Lightning fit, run as a subprocess of this
package in worker mode (``--run CONFIG``; Lightning re-runs that command line for
ranks 1-3), in its own process group, killed as a whole on ``--timeout``.

Usage::

    python -m benchmarks.imbalance                                  # every configuration (~10-12 min)
    python -m benchmarks.imbalance --steps 40 --only ddp_balanced,eager_sgd_balanced
    python -m benchmarks.imbalance --repeats 3                      # medians [min-max] of 3 runs
    python -m benchmarks.imbalance --threads 3 --out benchmarks/results/imbalance_16core.json  # 16 cores

Run from the repository's root; the package need not be installed (the fits
are started as ``python -m benchmarks.imbalance --run CONFIG`` in that directory).

Modules: ``configs`` (the configurations), ``task`` (data and model, shared
with other benchmarks), ``worker`` (one rank of one fit), ``report`` (figures,
table, plot), ``runner`` (calibration and the fits, the command line).

Writes ``benchmarks/results/imbalance.json`` (every figure, per rank and per
run, plus the environment) and ``benchmarks/results/imbalance.png``. The figures
are only meaningful on an otherwise idle machine: the load average at the
start is recorded in the JSON.
"""
