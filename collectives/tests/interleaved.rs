//! Exchanges that carry a local copy along (`algo::exchange_interleaved`): the out-of-place
//! all-gather's first recursive-doubling round and the 2-rank all-to-all, at sizes that take
//! that path (blocks of 4 MiB and more), with uneven pieces and unequal blocks; every byte
//! compared with the answer each rank computes on its own. In-place all-to-all, which now leaves
//! the own block where it is, is checked alongside.

use crate::common::world;
use tutti_collectives::{Algo, Comm};

const MIB: usize = 1 << 20;

/// Byte `i` of rank `r`'s contribution: varied, and different for every rank.
fn byte(r: usize, i: usize) -> u8 {
    ((i * 31 + r * 17 + i / 4093) % 251) as u8
}

#[test]
fn out_of_place_allgather_with_the_copy_interleaved() {
    for n in [2, 4] {
        world(n, 256 << 10, |c| {
            let r = c.rank();
            // 4 MiB + 3 bytes per rank: four whole pieces and a 3-byte one.
            let len = 4 * MIB + 3;
            let mine: Vec<u8> = (0..len).map(|i| byte(r, i)).collect();
            let want: Vec<u8> = (0..n).flat_map(|q| (0..len).map(move |i| byte(q, i))).collect();
            // With 4 ranks recursive doubling is forced (the table picks the ring there); its
            // first round interleaves, the second exchanges two blocks whole.
            let cc = c.with_algo(Algo::RecursiveDoubling);
            let mut out = vec![0u8; n * len];
            let st = cc.allgather(&mine, &mut out).unwrap();
            assert_eq!(st.algo, Algo::RecursiveDoubling);
            let bad = out.iter().zip(&want).position(|(a, b)| a != b);
            assert!(bad.is_none(), "n={n} rank {r}: byte {bad:?} differs");
            // The next call sees a clean state (every piece's tag was matched).
            let mut again = vec![0u8; n * len];
            cc.allgather(&mine, &mut again).unwrap();
            assert!(again == want, "n={n} rank {r}: second call differs");
        });
    }
}

#[test]
fn unequal_allgather_blocks_with_one_large() {
    world(2, 256 << 10, |c| {
        let r = c.rank();
        // Rank 0 gives 5 MiB + 1 element, rank 1 gives 7 elements: only rank 0's side is cut
        // in pieces, and the ranks agree on every tag.
        let counts = [(5 * MIB) / 4 + 1, 7];
        let value = |q: usize, i: usize| (q * 1_000_003 + i) as i32;
        let mine: Vec<i32> = (0..counts[r]).map(|i| value(r, i)).collect();
        let want: Vec<i32> =
            (0..2).flat_map(|q| (0..counts[q]).map(move |i| value(q, i))).collect();
        let cc = c.with_algo(Algo::RecursiveDoubling);
        let mut out = vec![0i32; counts.iter().sum()];
        cc.allgatherv(&mine, &mut out, &counts).unwrap();
        let bad = out.iter().zip(&want).position(|(a, b)| a != b);
        assert!(bad.is_none(), "rank {r}: element {bad:?} differs");
    });
}

#[test]
fn two_rank_all_to_all_with_the_copy_interleaved() {
    world(2, 256 << 10, |c| {
        let r = c.rank();
        // Equal blocks of 4 MiB + 5 bytes, out of place and in place.
        let blk = 4 * MIB + 5;
        // Rank q's block for rank j: byte(q * 2 + j, i).
        let input: Vec<u8> =
            (0..2).flat_map(|j| (0..blk).map(move |i| byte(r * 2 + j, i))).collect();
        let want: Vec<u8> =
            (0..2).flat_map(|q| (0..blk).map(move |i| byte(q * 2 + r, i))).collect();
        let mut out = vec![0u8; 2 * blk];
        // Pairwise exchange, as messages (direct reads, which the automatic choice takes in
        // memory, have no copy to interleave).
        let c = c.with_algo(Algo::Pairwise);
        let st = c.all_to_all(&input, &mut out).unwrap();
        assert_eq!(st.algo, Algo::Pairwise);
        assert!(out == want, "rank {r}: out of place differs");
        let mut buf = input.clone();
        c.all_to_all_inplace(&mut buf).unwrap();
        assert!(buf == want, "rank {r}: in place differs");
    });
}

/// A 2-rank all-to-all-v where this rank sends `sc[j]` bytes to rank `j` and the ranks' counts
/// mirror each other (so it receives `sc[j]` from rank `j` too); every byte checked.
fn check_a2av(c: &Comm, sc: &[usize], what: &str) {
    let r = c.rank();
    let input: Vec<u8> = (0..2).flat_map(|j| (0..sc[j]).map(move |i| byte(r * 2 + j, i))).collect();
    let want: Vec<u8> = (0..2).flat_map(|q| (0..sc[q]).map(move |i| byte(q * 2 + r, i))).collect();
    let mut out = vec![0u8; sc.iter().sum()];
    c.all_to_all_v(&input, sc, &mut out, sc).unwrap();
    let bad = out.iter().zip(&want).position(|(a, b)| a != b);
    assert!(bad.is_none(), "{what} rank {r}: byte {bad:?} differs");
}

#[test]
fn two_rank_all_to_all_v_with_unequal_blocks() {
    // Large to the peer and small to itself, and the other way round: the copy keeps pace with
    // the send by fraction, whichever is larger.
    for (own, other) in [(3usize, 6 * MIB + 1), (6 * MIB + 1, 3), (5 * MIB, 4 * MIB + 7)] {
        world(2, 256 << 10, |c| {
            // Each rank sends `own` bytes to itself and `other` bytes to its peer.
            let sc: Vec<usize> = (0..2).map(|j| if j == c.rank() { own } else { other }).collect();
            check_a2av(&c, &sc, &format!("own={own} other={other}"));
        });
    }
}

#[test]
fn two_rank_all_to_all_v_with_a_large_own_block_on_one_rank() {
    // Only rank 0 keeps a large block; 2 MiB go each way (whole messages on both sides).
    world(2, 256 << 10, |c| {
        let sc = if c.rank() == 0 { vec![5 * MIB + 1, 2 * MIB] } else { vec![2 * MIB, 9] };
        check_a2av(&c, &sc, "large own block on rank 0");
    });
}

#[test]
fn in_place_all_to_all_keeps_the_own_block_for_every_algorithm() {
    for n in [3, 4] {
        for algo in [Algo::Pairwise, Algo::PostAll, Algo::Bruck] {
            world(n, 1 << 10, |c| {
                let r = c.rank();
                let blk = 1000;
                let mut buf: Vec<u8> =
                    (0..n).flat_map(|j| (0..blk).map(move |i| byte(r * n + j, i))).collect();
                let want: Vec<u8> =
                    (0..n).flat_map(|q| (0..blk).map(move |i| byte(q * n + r, i))).collect();
                c.with_algo(algo).all_to_all_inplace(&mut buf).unwrap();
                assert!(buf == want, "n={n} {algo:?} rank {r}: in place differs");
            });
        }
    }
}

#[test]
fn unequal_allgather_blocks_at_four_ranks() {
    // Pairs whose windows differ in length cut them into different numbers of pieces: round
    // two must still find the same tags on both sides (each round starts its tags at a multiple
    // of the most a message can take).
    world(4, 256 << 10, |c| {
        let r = c.rank();
        let counts = [(5 * MIB) / 4 + 1, 7, (4 * MIB) / 4, 0];
        let value = |q: usize, i: usize| (q * 1_000_003 + i) as i32;
        let mine: Vec<i32> = (0..counts[r]).map(|i| value(r, i)).collect();
        let want: Vec<i32> =
            (0..4).flat_map(|q| (0..counts[q]).map(move |i| value(q, i))).collect();
        let cc = c.with_algo(Algo::RecursiveDoubling);
        for _ in 0..2 {
            let mut out = vec![0i32; counts.iter().sum()];
            cc.allgatherv(&mine, &mut out, &counts).unwrap();
            let bad = out.iter().zip(&want).position(|(a, b)| a != b);
            assert!(bad.is_none(), "rank {r}: element {bad:?} differs");
        }
    });
}
