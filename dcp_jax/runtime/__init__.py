"""The compiled programs: the model's decode and prefill bodies, `DecodeStep` / `PrefillStep` (buckets, one
transfer, donation), the runner that holds weights and KV state, and the jaxpr check of the step's inputs."""
