"""Write the synthetic image TFRecords of ``synthetic_tfrecord_images`` to a folder or bucket.

    uv run python examples/keras_app_tfrecords/write_tfrecords.py gs://my-bucket/synthetic-images \
        --train-files 8 --records-per-file 512

``gs://`` goes through syncswitch.storage, so ``STORAGE_EMULATOR_HOST`` points it at an emulator.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

# The example package sits beside this script; it is user code, not an installed package.
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from tfrecord_example.synthetic import write_tfrecords  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir", help="a local folder or gs:// URI (the job's data_dir)")
    parser.add_argument("--train-files", type=int, default=4)
    parser.add_argument("--records-per-file", type=int, default=256)
    parser.add_argument("--test-files", type=int, default=1)
    parser.add_argument("--test-records-per-file", type=int, default=512)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    written = write_tfrecords(
        args.out_dir,
        args.train_files,
        records_per_file=args.records_per_file,
        num_test_files=args.test_files,
        test_records_per_file=args.test_records_per_file,
        seed=args.seed,
    )
    print(json.dumps({"data_dir": args.out_dir, "files": written}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
