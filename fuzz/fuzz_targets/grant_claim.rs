//! A grant claim's body (side-channel op 4), as the claim handler reads it: errors, never
//! panics; a claim that decodes re-encodes to canonical bytes that decode to the same claim.
#![no_main]

use libfuzzer_sys::fuzz_target;
use xfer::grant_offer::recode_claim;

fuzz_target!(|data: &[u8]| {
    if let Ok(canonical) = recode_claim(data) {
        assert_eq!(recode_claim(&canonical).expect("canonical bytes decode"), canonical);
    }
});
