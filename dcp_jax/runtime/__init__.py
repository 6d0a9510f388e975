"""The compiled programs: the model's step body (decode rows and prefill chunks alike), `StepProgram` (buckets, one
transfer, donation), the runner that holds weights and KV state, and the jaxpr check of the step's inputs."""
