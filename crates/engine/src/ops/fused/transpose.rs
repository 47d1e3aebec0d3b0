//! A 16×16 block of 32-bit values transposed: the step that turns a transposed operand's
//! contiguous lines into the rows a tile reads. A scalar transpose stores one value at a time;
//! with AVX-512 it is 64 shuffles of whole rows (the tile packing of a transposed view ran at a
//! fraction of the tile rate without it: docs/PERFORMANCE.md).

/// 16 rows of 16 values.
pub(super) type Block = [[u32; 16]; 16];

/// `out[j][i] = t[i][j]`.
#[inline(always)]
pub(super) fn transposed(t: &Block) -> Block {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx512f") {
        // SAFETY: the CPU has AVX-512F.
        return unsafe { avx512(t) };
    }
    let mut out = [[0u32; 16]; 16];
    for (i, row) in t.iter().enumerate() {
        for (j, &v) in row.iter().enumerate() {
            out[j][i] = v;
        }
    }
    out
}

/// Four stages: 32-bit and 64-bit interleaves within 128-bit lanes give, for each group of
/// four rows `g` and `j < 4`, a vector whose lane `L` holds column `4L + j` of those rows; two
/// rounds of lane shuffles then gather each column's four lanes.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn avx512(t: &Block) -> Block {
    use std::arch::x86_64::*;
    let mut out = [[0u32; 16]; 16];
    // SAFETY: each row is 16 u32 (64 bytes), read and written unaligned.
    unsafe {
        let r: [__m512i; 16] = std::array::from_fn(|i| _mm512_loadu_si512(t[i].as_ptr().cast()));
        // u[g][j]: lane L = column 4L + j of rows 4g..4g+4.
        let u: [[__m512i; 4]; 4] = std::array::from_fn(|g| {
            let (a, b, c, d) = (r[4 * g], r[4 * g + 1], r[4 * g + 2], r[4 * g + 3]);
            let (ab_lo, ab_hi) = (_mm512_unpacklo_epi32(a, b), _mm512_unpackhi_epi32(a, b));
            let (cd_lo, cd_hi) = (_mm512_unpacklo_epi32(c, d), _mm512_unpackhi_epi32(c, d));
            [
                _mm512_unpacklo_epi64(ab_lo, cd_lo),
                _mm512_unpackhi_epi64(ab_lo, cd_lo),
                _mm512_unpacklo_epi64(ab_hi, cd_hi),
                _mm512_unpackhi_epi64(ab_hi, cd_hi),
            ]
        });
        for j in 0..4 {
            // Lanes 0 and 2 (0x88) or 1 and 3 (0xdd) of groups 0, 1 and of groups 2, 3.
            let even01 = _mm512_shuffle_i32x4::<0x88>(u[0][j], u[1][j]);
            let odd01 = _mm512_shuffle_i32x4::<0xdd>(u[0][j], u[1][j]);
            let even23 = _mm512_shuffle_i32x4::<0x88>(u[2][j], u[3][j]);
            let odd23 = _mm512_shuffle_i32x4::<0xdd>(u[2][j], u[3][j]);
            let columns = [
                _mm512_shuffle_i32x4::<0x88>(even01, even23),
                _mm512_shuffle_i32x4::<0x88>(odd01, odd23),
                _mm512_shuffle_i32x4::<0xdd>(even01, even23),
                _mm512_shuffle_i32x4::<0xdd>(odd01, odd23),
            ];
            for (lane, c) in columns.into_iter().enumerate() {
                _mm512_storeu_si512(out[4 * lane + j].as_mut_ptr().cast(), c);
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_block_transposed_swaps_rows_and_columns() {
        let t: Block = std::array::from_fn(|i| std::array::from_fn(|j| (i * 1000 + j) as u32));
        let out = transposed(&t);
        for i in 0..16 {
            for j in 0..16 {
                assert_eq!(out[j][i], t[i][j], "({i}, {j})");
            }
        }
    }
}
