"""Where a policy becomes a running model: the handle (`handle`), what was applied
(`reports`), module selection and forward overrides (`wrap`), one applier per backend
(`torch_applier`, `deepspeed_applier`, registered in `applying.APPLIERS`) and the offload
engine (`offload`). The public entry point, `actcfg.apply`, is in `actcfg.api`."""
