"""spark-submit entry point: ``spark-submit spark/balance_job.py --help``.

The job itself is ``qosmq_bench.spark_balance`` (installed with the package, so
executors import it by name); this file only starts it.
"""

from qosmq_bench.spark_balance import main

if __name__ == "__main__":
    raise SystemExit(main())
