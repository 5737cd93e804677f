"""spark-submit entry point: ``spark-submit spark/phoenix_job.py --help``.

The job itself is ``qosmq_bench.spark_phoenix`` (installed with the package, so
executors import it by name); this file only starts it.
"""

from qosmq_bench.spark_phoenix import main

if __name__ == "__main__":
    raise SystemExit(main())
