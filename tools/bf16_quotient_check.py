"""Checks, in rational arithmetic, that the quantization kernels' quotient of a bf16 value by its
group's scale (`quotient_of_bf16` in crates/moeflow/src/backend/cuda/kernels/quant.cu: the
product q = v * y with y = 1 / s rounded, then fma(fma(-s, q, v), y, q)) is the correctly rounded
quotient v / s, for every pair of bf16 significands of v and of the group's largest value a
(s = a / 448 or a / 127 rounded to f32), v up to 2^21 below a. Prints the cases checked and any
that differ; exits 1 if one does.

    python3 tools/bf16_quotient_check.py
"""

import sys
from fractions import Fraction


def round_f32(x):
    """x rounded to the nearest binary32 value (ties to even), as a Fraction; normal range."""
    if x == 0:
        return Fraction(0)
    sign = -1 if x < 0 else 1
    x = abs(x)
    e = x.numerator.bit_length() - x.denominator.bit_length()
    if Fraction(2) ** e > x:
        e -= 1
    scaled = x / Fraction(2) ** (e - 23)
    n, rest = divmod(scaled.numerator, scaled.denominator)
    rest = Fraction(rest, scaled.denominator)
    if rest > Fraction(1, 2) or (rest == Fraction(1, 2) and n % 2 == 1):
        n += 1
    return sign * Fraction(n) * Fraction(2) ** (e - 23)


def main():
    significands = [Fraction(128 + i, 128) for i in range(128)]
    wrong = 0
    for divisor in (448, 127):
        cases = 0
        for a in significands:
            s = round_f32(a / divisor)
            y = round_f32(1 / s)
            for d in range(22):
                for v in (m / Fraction(2) ** d for m in significands):
                    if v > a:
                        continue
                    q = round_f32(v * y)
                    q = round_f32(q + round_f32(v - s * q) * y)
                    cases += 1
                    if q != round_f32(v / s):
                        wrong += 1
                        print(f"differs: a {float(a)}, v {float(v)}, divisor {divisor}")
        print(f"divisor {divisor}: {cases} cases")
    print(f"{wrong} differ")
    sys.exit(1 if wrong else 0)


if __name__ == "__main__":
    main()
