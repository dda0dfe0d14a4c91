"""What an operator runs beside a pipeline: status, doctor, drain and maintenance."""
