"""`python -m tf_sok.data.convert --input day_0.tsv --output out_dir --format parquet|tfrecord`"""
from tf_sok.python.data.convert import main

if __name__ == "__main__":
    main()
