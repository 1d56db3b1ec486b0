"""What files and tables say, read without I/O: Parquet footers' Thrift, INT96, schemas, sizes, catalog records, listing rules, deletion vectors. Pure."""
