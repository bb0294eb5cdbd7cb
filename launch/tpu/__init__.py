"""The Cloud TPU launcher's parts (`launch/tpu_pod.py` is its command line): `options` (the
command line as frozen records), `topology` (accelerator types, peaks, runtime names), `gcloud`
(running commands), `records` (what each TPU was given), `remote` (the scripts run on the VMs),
`commands` (the subcommands), `errors`. It imports from the framework only modules that import
no TensorFlow (`framework.core.errors`, `releases`, `tpu_generations`): it runs on a
workstation where TensorFlow need not be installed."""
